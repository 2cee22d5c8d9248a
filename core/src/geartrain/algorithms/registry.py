"""A small name -> object registry; used by the advantage, policy-loss and reward tables."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Named entries of one kind (``kind`` appears in error messages).

    Registering a different object under a taken name is an error unless ``override=True``;
    registering the same object twice is a no-op (module reloads in notebooks).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, *, override: bool = False) -> Callable[[T], T]:
        """Decorator: ``@registry.register("name")`` adds the decorated object."""

        def decorator(obj: T) -> T:
            self.add(name, obj, override=override)
            return obj

        return decorator

    def add(self, name: str, obj: T, *, override: bool = False) -> None:
        current = self._entries.get(name)
        if current is not None and current is not obj and not override:
            raise ValueError(
                f"{self.kind} '{name}' is already registered ({current!r}); pick another name or pass override=True"
            )
        self._entries[name] = obj

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} '{name}'; registered: {', '.join(sorted(self._entries))}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
