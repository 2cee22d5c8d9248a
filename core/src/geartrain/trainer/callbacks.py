"""Code run at points of a run (TRL's ``TrainerCallback``): after each RL step with its
metrics, after each validation, after each checkpoint is saved, at the end of training.

A callback is any object with some of the methods of :class:`Callback` (subclass it, or
write only the methods you need); ``run_job(config, callbacks=[obj])`` from Python, or
``trainer.callbacks = ["my_callbacks.py:PrintLoss"]`` in a job file (a class, built with no
arguments, or an object; ``file.py:Name`` relative to the job file, or
``package.module:Name``). They run on the driver, in order, between steps: a slow callback
slows the run. An exception in a callback ends the run with one line naming the callback,
the event and the error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from geartrain.errors import GeartrainError
from geartrain.user_code import is_file_spec, load_from_file

EVENTS = ("on_step_end", "on_evaluate", "on_save", "on_train_end")
"""The methods a callback may have, in the order a run reaches them."""


class Callback:
    """The events, each a no-op here; override the ones you need."""

    def on_step_end(self, step: int, metrics: Mapping[str, float]) -> None:
        """After RL step ``step`` (1-based) with its logged metrics (``reward/mean``,
        ``reward/accuracy``, ``actor/pg_loss``... and ``val/*`` when it validated)."""

    def on_evaluate(self, step: int, metrics: Mapping[str, float]) -> None:
        """After a validation (``step`` 0: before training) with its ``val/*`` metrics."""

    def on_save(self, step: int, path: Path) -> None:
        """After the checkpoint of ``step`` is complete on disk: ``path`` is the actor's
        (``<output_dir>/checkpoints/actor/step_00000010``; older ones go by
        ``trainer.keep_last``)."""

    def on_train_end(self, steps: int, metrics: Mapping[str, Any]) -> None:
        """After the last step (and the export): ``metrics`` holds ``accuracy_before``,
        ``accuracy_after`` and ``output_dir``."""


def load_callbacks(specs: Sequence[Any], base_dir: str | None) -> list[Any]:
    """The callback objects of ``specs`` (objects as they are; ``file.py:Name`` /
    ``package.module:Name`` imported, a class built with no arguments). Raises
    :class:`GeartrainError` naming the spec when one cannot be loaded or has none of
    :data:`EVENTS`."""
    callbacks = []
    for i, spec in enumerate(specs):
        key = f"trainer.callbacks[{i}]"
        target = spec
        if isinstance(spec, str):
            if is_file_spec(spec):
                target = load_from_file(spec, base_dir, what="callback", key=key)
            else:
                target = _import(spec, key)
        if isinstance(target, type):
            try:
                target = target()
            except Exception as exc:  # the user's class: one line
                raise GeartrainError(f"{key}: {spec} could not be built with no arguments: {exc}") from None
        if not any(callable(getattr(target, name, None)) for name in EVENTS):
            raise GeartrainError(f"{key}: {spec!r} has none of the callback methods {', '.join(EVENTS)}")
        _callable_as_events(target, key)
        callbacks.append(target)
    return callbacks


def _callable_as_events(target: Any, key: str) -> None:
    """Raise :class:`GeartrainError` when one of ``target``'s event methods cannot take the two
    arguments a run passes it (a ``transformers.TrainerCallback``'s ``on_step_end(args, state,
    control)`` failed after the first step, naming a method the user had not written)."""
    import inspect

    for event in EVENTS:
        method = getattr(target, event, None)
        if not callable(method):
            continue
        try:
            inspect.signature(method).bind(1, {})
        except TypeError:
            name = type(target).__name__
            raise GeartrainError(
                f"{key}: {name}.{event}{inspect.signature(method)} cannot be called as {event}(step, metrics) as a "
                "run calls it; geartrain's callbacks are not transformers' TrainerCallback: write the methods of "
                "geartrain.trainer.callbacks.Callback (docs/guide.md)"
            ) from None
        except ValueError:  # a builtin without a signature: it is called as it is
            continue


def _import(spec: str, key: str) -> Any:
    import importlib

    module_name, _, name = spec.partition(":")
    if not name:
        raise GeartrainError(f"{key}: '{spec}' should be file.py:Name or package.module:Name")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise GeartrainError(f"{key}: cannot load '{spec}': {exc}") from None


class Callbacks:
    """The run's callbacks, called for each event in order."""

    def __init__(self, callbacks: Sequence[Any]) -> None:
        self.callbacks = list(callbacks)

    def __call__(self, event: str, *args: Any) -> None:
        for callback in self.callbacks:
            method = getattr(callback, event, None)
            if method is None:
                continue
            try:
                method(*args)
            except Exception as exc:  # the user's code: one line naming it
                name = type(callback).__name__
                raise GeartrainError(f"callback {name}.{event} failed: {type(exc).__name__}: {exc}") from exc
            except (SystemExit, GeneratorExit) as exc:  # not the run's end: it would stop with exit 0 and no word
                name = type(callback).__name__
                raise GeartrainError(
                    f"callback {name}.{event} called sys.exit({'' if exc.args == () else repr(exc.args[0])}) "
                    "(a callback cannot end the run: raise an exception to stop it with an error)"
                ) from exc
