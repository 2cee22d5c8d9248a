"""The reward-function registry and the resolution of user functions.

A reward function scores one response::

    fn(response: str, ground_truth: str, *, prompt: str, meta: dict) -> float | dict

returning a score, or a dict with ``score`` and optional numeric extras (``acc``...) that
become metrics. A user function may take fewer keyword arguments (e.g. only
``(response, ground_truth)``): :func:`get_reward` passes only the ones it accepts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from geartrain.algorithms.registry import Registry
from geartrain.errors import GeartrainError
from geartrain.user_code import import_object

RewardOutput = float | int | bool | Mapping[str, Any]


class RewardFn(Protocol):
    """The uniform signature (see the module docstring)."""

    def __call__(self, response: str, ground_truth: str, *, prompt: str, meta: dict[str, Any]) -> RewardOutput: ...


REWARDS: Registry[RewardFn] = Registry("reward function")


def register_reward(name: str, *, override: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function under ``name``."""
    return REWARDS.register(name, override=override)


def get_reward(spec: str | Callable[..., RewardOutput]) -> RewardFn:
    """Resolve ``spec`` to a function with the uniform signature.

    ``spec`` is a callable, a registered name (``gsm8k``, ``math_boxed``...), or a dotted
    path ``package.module:function`` / ``package.module.function`` imported on demand.
    Raises :class:`geartrain.GeartrainError` naming the spec when it cannot be resolved.
    """
    if callable(spec):
        return _adapt(spec)
    if spec in REWARDS:
        return REWARDS.get(spec)
    if ":" in spec or "." in spec:
        return _adapt(_import(spec))
    raise GeartrainError(
        f"unknown reward function '{spec}'; registered: {', '.join(REWARDS.names())}; "
        "or give a dotted path 'package.module:function'"
    )


def _import(path: str) -> Callable[..., RewardOutput]:
    obj = import_object(path, what="reward function")
    if not callable(obj):
        raise GeartrainError(f"reward function '{path}' is not callable ({type(obj).__name__})")
    return obj


def _adapt(fn: Callable[..., RewardOutput]) -> RewardFn:
    """``fn`` itself if it accepts ``prompt`` and ``meta`` keywords, else a wrapper that
    drops the ones it does not take. Adapting an adapted function returns it unchanged."""
    if getattr(fn, "_geartrain_adapted", False):
        return fn  # type: ignore[return-value]
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature: pass everything
        return fn  # type: ignore[return-value]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn  # type: ignore[return-value]
    accepted = {k for k in ("prompt", "meta") if k in params}
    if accepted == {"prompt", "meta"}:
        return fn  # type: ignore[return-value]

    def adapted(response: str, ground_truth: str, *, prompt: str, meta: dict[str, Any]) -> RewardOutput:
        extra = {k: v for k, v in (("prompt", prompt), ("meta", meta)) if k in accepted}
        return fn(response, ground_truth, **extra)

    adapted.__name__ = getattr(fn, "__name__", "reward")
    adapted.__wrapped__ = fn  # type: ignore[attr-defined]
    adapted._geartrain_adapted = True  # type: ignore[attr-defined]
    return adapted
