"""Resolving ``rollout.agent.environment`` to a factory of environments."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from geartrain.agents.environment import EnvironmentFactory
from geartrain.agents.tools import ToolEnvironment
from geartrain.agents.trl_environment import TRLEnvironmentPool, is_trl_environment
from geartrain.errors import GeartrainError
from geartrain.user_code import import_object, is_file_spec, load_from_file

__all__ = ["EnvironmentRouter", "load_environment", "load_environments"]


def load_environment(
    spec: str | type | Callable[..., Any],
    *,
    kwargs: Mapping[str, Any] | None = None,
    base_dir: str | None = None,
    key: str = "rollout.agent.environment",
) -> EnvironmentFactory:
    """A factory of environments from ``spec``: a class or callable, ``file.py:Name``
    (relative to ``base_dir``), ``package.module:Name`` or a built-in name
    (``tools``: :class:`geartrain.agents.tools.ToolEnvironment`). ``kwargs`` are passed to
    it for every episode. A TRL ``environment_factory`` class (``reset`` and tool methods,
    no ``step``) is wrapped in :class:`~geartrain.agents.trl_environment.TRLEnvironment`,
    its instances pooled and reused as TRL reuses them (``kwargs`` passed once per instance).
    Raises :class:`GeartrainError` naming ``key`` when the spec does
    not resolve or its objects lack ``reset``/``step``."""
    target: Any
    if isinstance(spec, str):
        if spec in _BUILTINS:
            target = _BUILTINS[spec]()
        elif is_file_spec(spec):
            target = load_from_file(spec, base_dir, what="environment", key=key)
        elif ":" in spec or "." in spec:
            target = import_object(spec, what=f"environment ({key})")
        else:
            raise GeartrainError(
                f"{key} = '{spec}' is not a built-in environment ({', '.join(_BUILTINS)}); "
                "name a class as 'my_env.py:Class' or 'package.module:Class'"
            )
    else:
        target = spec
    if not callable(target):
        raise GeartrainError(f"{key} = '{spec}' is not a class or factory ({type(target).__name__})")
    arguments = dict(kwargs or {})
    if target is ToolEnvironment and isinstance(arguments.get("tools"), list | tuple):
        # tools in files next to the job file, as reward functions are named
        arguments["tools"] = [
            load_from_file(t, base_dir, what="tool", key=f"{key}_kwargs.tools")
            if isinstance(t, str) and is_file_spec(t)
            else t
            for t in arguments["tools"]
        ]
    if is_trl_environment(target):  # TRL's environment_factory: tools are its methods
        return TRLEnvironmentPool(target, arguments)
    missing = [m for m in ("reset", "step") if isinstance(target, type) and not callable(getattr(target, m, None))]
    if missing:
        raise GeartrainError(
            f"{key} = '{spec}': {target.__name__} has no {' or '.join(missing)} method "
            "(see geartrain.agents.Environment; a TRL environment_factory class needs reset and its tool methods)"
        )
    for name in ("reset", "step", "close", "final_reward"):
        method = getattr(target, name, None) if isinstance(target, type) else None
        kind = _not_plain(method)
        if kind is not None:
            raise GeartrainError(
                f"{key} = '{spec}': {target.__name__}.{name} is {kind}; geartrain calls an environment's methods "
                "and uses what they return (a coroutine or generator object is no result): make it a plain def"
            )
    return lambda: target(**arguments)


def _not_plain(method: Any) -> str | None:
    """What kind of function ``method`` is when calling it returns no result but an object
    to drive (``"async def"``, ``"a generator"``, ``"an async generator"``), else ``None``."""
    if method is None:
        return None
    if inspect.iscoroutinefunction(method):
        return "async def"
    if inspect.isasyncgenfunction(method):
        return "an async generator"
    if inspect.isgeneratorfunction(method):
        return "a generator"
    return None


class EnvironmentRouter:
    """Named environments, one per episode chosen by its task's ``key`` column (TRL's dict
    ``environment_factory``): ``factories`` maps each name to its factory."""

    def __init__(self, factories: Mapping[str, EnvironmentFactory], key: str = "environment") -> None:
        self.factories = dict(factories)
        self.key = key

    def name_of(self, task: Mapping[str, Any]) -> str:
        """The environment ``task`` names; raises :class:`GeartrainError` when it names
        none of them."""
        name = task.get(self.key)
        if not isinstance(name, str) or name not in self.factories:
            got = "has none" if name is None else f"says {name!r}"
            raise GeartrainError(
                f"the row's '{self.key}' column names its environment, one of {', '.join(self.factories)} "
                f"(rollout.agent.environment); it {got}"
            )
        return name

    def for_task(self, task: Mapping[str, Any]) -> EnvironmentFactory:
        """The factory of ``task``'s environment."""
        return self.factories[self.name_of(task)]

    def task_for_reset(self, task: Mapping[str, Any]) -> dict[str, Any]:
        """``task`` without the control column (TRL does not pass it to ``reset``)."""
        return {k: v for k, v in task.items() if k != self.key}


def load_environments(
    environment: str | Mapping[str, str],
    *,
    kwargs: Mapping[str, Any] | None = None,
    key: str = "environment",
    base_dir: str | None = None,
) -> EnvironmentFactory | EnvironmentRouter:
    """``rollout.agent.environment`` resolved: one factory (:func:`load_environment`), or,
    for a table of named environments, an :class:`EnvironmentRouter` over theirs
    (``kwargs`` then holds a table per name)."""
    if isinstance(environment, str):
        return load_environment(environment, kwargs=kwargs, base_dir=base_dir)
    per_name = dict(kwargs or {})
    factories = {}
    for name, spec in environment.items():
        try:
            factories[name] = load_environment(
                spec, kwargs=per_name.get(name), base_dir=base_dir, key=f"rollout.agent.environment.{name}"
            )
        except GeartrainError as exc:
            raise GeartrainError(f"{name} = '{spec}': {exc}") from exc
    return EnvironmentRouter(factories, key)


_BUILTINS: dict[str, Callable[[], Any]] = {"tools": lambda: ToolEnvironment}
