"""Exceptions geartrain raises for problems a user can fix. Each message says what is
wrong, where, and how to fix it."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class GeartrainError(Exception):
    """Base class of geartrain's user-facing errors."""


class PluginError(GeartrainError):
    """A plugin could not be loaded or does not meet the hook contract.

    ``name``, ``kind``, ``distribution`` and ``version`` identify the plugin; the message
    ends with the fix.
    """

    def __init__(
        self,
        message: str,
        *,
        name: str,
        kind: str,
        distribution: str | None = None,
        version: str | None = None,
        fix: str = "",
    ) -> None:
        self.name = name
        self.kind = kind
        self.distribution = distribution
        self.version = version
        self.fix = fix
        where = f"{kind} plugin '{name}'"
        if distribution:
            where += f" (distribution {distribution} {version or '?'})"
        text = f"{where}: {message}"
        if fix:
            text += f"\n  fix: {fix}"
        super().__init__(text)


class PluginNotFoundError(GeartrainError):
    """The configuration asks for a backend that is not installed (or not allowed)."""


class ConfigError(GeartrainError):
    """A configuration has one or more problems; ``problems`` lists ``(path, message)``.

    Backends raise it too, for a user's mistake in their section (a bad option, an
    impossible combination), with paths relative to that section (``options.sp_size``,
    ``parallel.tp``): the core prefixes the section's path (``actor.engine.``) and the CLI
    prints it without a traceback."""

    def __init__(
        self, problems: list[tuple[str, str]], source: str | None = None, *, notes: Sequence[str] = ()
    ) -> None:
        self.problems = problems
        self.source = source
        head = f"invalid configuration{f' in {source}' if source else ''}: {len(problems)} problem(s)"
        lines = [head] + [f"  {path}: {msg}" if path else f"  {msg}" for path, msg in problems]
        # context and the way out, printed after the problems and not counted as ones
        super().__init__("\n".join(lines + [f"  {note}" for note in notes]))


class ConfigFileError(ConfigError):
    """The config file itself cannot be read (missing, a directory, not UTF-8): one line."""

    def __init__(self, path: str, message: str) -> None:
        self.problems = [("", message)]
        GeartrainError.__init__(self, f"config file {path}: {message}")


class DataError(GeartrainError):
    """A dataset row is malformed; the message names the file and the row number."""


class RunDirectoryRemovedError(GeartrainError):
    """The job's output directory was removed while it ran: what it had written is gone, so
    it stops rather than write a run with no beginning."""


class CheckpointError(GeartrainError):
    """A checkpoint is missing, incomplete or does not match the model."""


class NonFiniteError(GeartrainError):
    """The policy cannot go on: its weights, or the logits they produce, are not finite
    (NaN or inf). The trainer stops the run on it (``geartrain train`` exits 2), keeping
    the checkpoints saved so far."""


class NonFiniteLogitsError(NonFiniteError):
    """A rollout computed non-finite logits (so NaN or infinite log-probs) for sampled
    tokens: the weights it generates with overflowed, though each of them may be finite."""


class NonFiniteWeightsError(NonFiniteError):
    """A weight sync found a non-finite tensor among the weights it was to publish to the
    rollout; ``name`` is its name. Nothing of that bucket or later ones was sent."""

    def __init__(self, name: str, message: str) -> None:
        self.name = name
        super().__init__(message)


def exception_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception behind it: its ``__cause__`` and ``__context__``, and the
    per-rank errors a ``torch.distributed.checkpoint`` ``CheckpointException`` wraps (DCP
    catches *any* exception of a rank's save or load, Ctrl-C's ``KeyboardInterrupt``
    included, and raises one of its own)."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: rank -> (error, traceback)
        if isinstance(failures, dict):
            for failure in failures.values():
                inner = getattr(failure, "exc", failure[0] if isinstance(failure, tuple) and failure else failure)
                todo.append(inner if isinstance(inner, BaseException) else None)
    return seen


_ANSI = None


def text_of(value: object, how: Callable[[object], str] = str) -> str:
    """``how(value)`` (``str`` or ``repr``) of a value a user's code made; where that itself
    raises (an int of more digits than Python converts, a broken ``__str__``/``__repr__``) a
    line saying so: naming the value must not become an error of its own."""
    try:
        return how(value)
    except Exception as exc:  # noqa: BLE001 - any __str__/__repr__ may raise anything
        return f"<{type(value).__name__} whose {how.__name__}() raised {type(exc).__name__}>"


def short_repr(value: object, limit: int = 60) -> str:
    """:func:`text_of` ``repr(value)``, cut to ``limit`` characters (``...`` marks the cut)."""
    text = text_of(value, repr)
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


def without_ansi(text: str) -> str:
    """``text`` without terminal escape sequences (colours, bold: torch's messages carry
    some), for one-line messages that may go to a file or a log."""
    global _ANSI
    if _ANSI is None:
        import re

        _ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
    return _ANSI.sub("", text)


def unpickling_reason(exc: BaseException) -> str:
    """The line of a ``torch.load(weights_only=True)`` refusal that says what it found (the
    blocked global), without escape codes; else its first line."""
    lines = [without_ansi(line).strip() for line in str(exc).strip().splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "Unsupported" in line or "unsupported" in line]
    return (named or lines or [type(exc).__name__])[0]


def without_python_advice(exc: BaseException) -> str:
    """``exc``'s message without Python's "; use sys.set_int_max_str_digits() ..." (an
    integer past its digit limit): raising the limit is not the user's to do."""
    return str(exc).split("; use sys.")[0]
