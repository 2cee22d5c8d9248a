"""What reward functions see of an episode's environment: TRL's ``environments`` argument.

TRL calls a reward function with ``environments``, the instances that ran the batch's
rollouts, and its examples read their state: ``[env.reward for env in environments]``. In
geartrain the instances live on the rollout ranks (another process, another machine) and
reward functions run on the trainer, so what crosses is a snapshot: when an episode ends,
:func:`capture_state` keeps the environment's plain-data attributes (numbers, text, ``None``,
and lists and dicts of them) with the episode record, and the reward function gets an
:class:`EnvironmentState` per sample that reads them as attributes.

What does not cross: methods (``env.score()``), and attributes holding anything else (a
client, a model, an array): reading one raises an ``AttributeError`` that says why and
what to do (keep what the reward needs in a plain attribute, or score in ``get_reward``,
which runs on the rank with the live instance). A value too large to ship with every
sample (a list or dict of more than :data:`MAX_ITEMS` items, text of more than
:data:`MAX_CHARS` characters) is left out the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["MAX_CHARS", "MAX_ITEMS", "EnvironmentState", "capture_state"]

MAX_ITEMS = 1000
"""Most items of one list or dict attribute (nested ones counted apart) that is kept."""
MAX_CHARS = 100_000
"""Most characters of one text attribute that is kept."""
_MAX_DEPTH = 4

_LEFT_OUT = "__left_out__"
_CLASS = "__class__"


class _NotPlain(Exception):
    """A value that is not plain data, or too large: why."""


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` as plain data (a numpy scalar becomes its number), or :class:`_NotPlain`."""
    if value is None or isinstance(value, bool | int | str):
        if isinstance(value, str) and len(value) > MAX_CHARS:
            raise _NotPlain(f"text of {len(value)} characters (more than {MAX_CHARS})")
        return value
    if isinstance(value, float):  # numpy's float64 too
        return float(value)
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a numpy or torch scalar
        number = value.item()
        if isinstance(number, bool | int | float):
            return number
    if isinstance(value, list | tuple | Mapping):
        if depth >= _MAX_DEPTH:
            raise _NotPlain(f"nested more than {_MAX_DEPTH} deep")
        if len(value) > MAX_ITEMS:
            raise _NotPlain(f"a {type(value).__name__} of {len(value)} items (more than {MAX_ITEMS})")
        if isinstance(value, Mapping):
            if not all(isinstance(k, str) for k in value):
                raise _NotPlain("a dict with keys that are not text")
            return {k: _plain(v, depth + 1) for k, v in value.items()}
        return [_plain(v, depth + 1) for v in value]
    raise _NotPlain(f"a {type(value).__name__}")


def capture_state(env: Any) -> dict[str, Any]:
    """The plain-data attributes of ``env`` (of the instance a TRL environment wraps, its
    ``instance``), as the episode left them, with the class name and why each other
    attribute was left out. Never raises: an attribute that cannot be read is left out."""
    target = getattr(env, "instance", env)
    try:
        attributes = dict(vars(target))
    except TypeError:  # no __dict__ (slots, builtins)
        attributes = {}
    kept: dict[str, Any] = {}
    left_out: dict[str, str] = {}
    for name, value in attributes.items():
        if name.startswith("__"):
            continue
        try:
            kept[name] = _plain(value)
        except _NotPlain as why:
            left_out[name] = str(why)
        except Exception as exc:  # noqa: BLE001 - a user's object that fails to be read is left out
            left_out[name] = f"a {type(value).__name__} that could not be read ({type(exc).__name__})"
    return {**kept, _CLASS: type(target).__name__, _LEFT_OUT: left_out}


class EnvironmentState:
    """An episode's environment as reward functions see it: its plain-data attributes
    (:func:`capture_state`) read as attributes, read-only."""

    __slots__ = ("_values", "_left_out", "_class")

    def __init__(self, state: Mapping[str, Any] | None) -> None:
        state = dict(state or {})
        object.__setattr__(self, "_left_out", dict(state.pop(_LEFT_OUT, {}) or {}))
        object.__setattr__(self, "_class", str(state.pop(_CLASS, "environment")))
        object.__setattr__(self, "_values", state)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        cls = object.__getattribute__(self, "_class")
        left_out = object.__getattribute__(self, "_left_out")
        if name in left_out:
            raise AttributeError(
                f"{cls}.{name} ({left_out[name]}) does not reach reward functions: they run on the trainer and "
                "get each environment's plain-data attributes (numbers, text, lists, dicts) as its episode left "
                f"them. Keep what the reward needs in such an attribute, or score in {cls}.get_reward"
            )
        raise AttributeError(
            f"{cls} had no attribute {name!r} when its episode ended (reward functions get its plain-data "
            "attributes only; methods run on the rollout ranks: score there in get_reward)"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("an environment's state in a reward function is read-only")

    def __repr__(self) -> str:
        values = object.__getattribute__(self, "_values")
        return f"EnvironmentState({object.__getattribute__(self, '_class')}: {values!r})"
