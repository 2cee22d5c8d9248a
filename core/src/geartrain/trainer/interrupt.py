"""What a job says when it is interrupted (Ctrl-C, SIGTERM: a timeout, a scheduler's
preemption, ``docker stop``, or SIGHUP: the terminal it runs in closed): one line, the same
from every placement (the inline driver here, the Ray driver in :mod:`geartrain.cluster`),
and the exit status a shell expects from the signal. SIGTERM and SIGHUP take Ctrl-C's path,
so a job stops the same way: its ranks closed, a previous run that ``--overwrite`` set aside
put back (:mod:`geartrain.trainer.rundir`). ``nohup`` (SIGHUP ignored) is left as it is."""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from geartrain.errors import exception_chain

#: Exit status of a process stopped by SIGINT (128 + 2), what shells and CI report.
EXIT_INTERRUPTED = 130
#: ... by SIGTERM (128 + 15) ...
EXIT_TERMINATED = 143
#: ... by SIGHUP (128 + 1) ...
EXIT_HUNG_UP = 129
#: ... and by SIGUSR1 (128 + 10), what Slurm's ``--signal=USR1@<seconds>`` sends before a
#: job's time limit.
EXIT_USR1 = 138

#: for each signal the watch takes: its disposition before the watch (the one it replaces
#: and puts back), the words of the one line, and the exit status
_STOPS: dict[int, tuple[object, str, int]] = {
    signal.SIGINT: (signal.default_int_handler, "interrupted", EXIT_INTERRUPTED),
    signal.SIGTERM: (signal.SIG_DFL, "terminated by SIGTERM", EXIT_TERMINATED),
    signal.SIGHUP: (signal.SIG_DFL, "stopped by SIGHUP (its terminal closed)", EXIT_HUNG_UP),
    # by default SIGUSR1 kills a process on the spot; a scheduler sends it as a warning
    signal.SIGUSR1: (signal.SIG_DFL, "stopped by SIGUSR1 (a scheduler's warning before its time limit?)", EXIT_USR1),
}


@dataclass
class RunPosition:
    """Where a job stands, for the interruption message: the RL step in progress (0 before
    the first, during the warm start and the checks) and the newest checkpoint that is
    complete on disk (``None``: none yet)."""

    output_dir: Path
    step: int = 0
    checkpoint: int | None = None
    gone: bool = False
    """The output directory was removed while the job ran."""


def interrupted_message(position: RunPosition, how: str = "interrupted") -> str:
    """The one line a job prints when Ctrl-C (``how``: "terminated by SIGTERM" for that
    signal) stops it::

        interrupted at step 7; the last complete checkpoint is step 5; continue with --resume

    A checkpoint being written when the interrupt landed is not complete (checkpoints are
    written atomically), so it is never the one named."""
    if position.gone:
        where = f"{position.output_dir} was removed while the job ran: none of its checkpoints is left"
    elif position.checkpoint is None:
        where = f"no checkpoint was completed in {position.output_dir}; start again with --overwrite"
    else:
        where = f"the last complete checkpoint is step {position.checkpoint}; continue with --resume"
    return f"{how} at step {position.step}; {where}"


def is_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` is Ctrl-C's ``KeyboardInterrupt`` or was raised because of one: a
    library that catches everything may hand it back wrapped (DCP's ``CheckpointException``
    when the interrupt lands during a checkpoint's save)."""
    return any(isinstance(e, KeyboardInterrupt) for e in exception_chain(exc))


class InterruptWatch:
    """Notes that SIGINT, SIGTERM, SIGHUP or SIGUSR1 arrived while it is entered (main thread only), then
    raises ``KeyboardInterrupt`` as Python's own SIGINT handler does. Code that swallows the
    ``KeyboardInterrupt`` and fails otherwise (C++ writing a checkpoint: torch.save's
    zip writer reports "unexpected pos" once a write was cut) still ends as an interrupt:
    :attr:`seen` says one arrived, :attr:`signum` which."""

    def __init__(self) -> None:
        self.seen = False
        self.signum: int | None = None
        self._installed: list[int] = []

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.seen = True
        self.signum = signum
        signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt

    @property
    def terminated(self) -> bool:
        """Whether the signal was SIGTERM, SIGHUP or SIGUSR1, not Ctrl-C (whose KeyboardInterrupt
        the CLI reports itself)."""
        return self.signum is not None and self.signum != signal.SIGINT

    @property
    def how(self) -> str:
        """The words of the one line: "interrupted", "terminated by SIGTERM", ..."""
        return _STOPS[self.signum][1] if self.signum in _STOPS else "interrupted"

    @property
    def exit_status(self) -> int:
        """128 + the signal's number, as a shell reports a process that signal stopped."""
        return _STOPS[self.signum][2] if self.signum in _STOPS else EXIT_INTERRUPTED

    def __enter__(self) -> InterruptWatch:
        # only over the default dispositions (a shell's Ctrl-C: Python's own handler; SIGTERM,
        # SIGHUP: death); SIG_IGN (nohup) and handlers of others are left alone (Ray's driver
        # installs its own SIGTERM handler, which exits through SystemExit)
        if threading.current_thread() is threading.main_thread():
            for signum, (default, _, _) in _STOPS.items():
                if signal.getsignal(signum) is default:
                    signal.signal(signum, self._handle)
                    self._installed.append(signum)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum in self._installed:
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, _STOPS[signum][0])  # type: ignore[arg-type]
        self._installed = []
