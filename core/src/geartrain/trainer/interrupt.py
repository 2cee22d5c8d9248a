"""What a job says when it is interrupted (Ctrl-C, or SIGTERM: a timeout, a scheduler's
preemption, ``docker stop``): one line, the same from every placement (the inline driver
here, the Ray driver in :mod:`geartrain.cluster`), and the exit status a shell expects from
the signal. SIGTERM takes Ctrl-C's path, so a job stops the same way: its ranks closed, a
previous run that ``--overwrite`` set aside put back (:mod:`geartrain.trainer.rundir`)."""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from geartrain.errors import exception_chain

#: Exit status of a process stopped by SIGINT (128 + 2), what shells and CI report.
EXIT_INTERRUPTED = 130
#: ... and by SIGTERM (128 + 15).
EXIT_TERMINATED = 143


@dataclass
class RunPosition:
    """Where a job stands, for the interruption message: the RL step in progress (0 before
    the first, during the warm start and the checks) and the newest checkpoint that is
    complete on disk (``None``: none yet)."""

    output_dir: Path
    step: int = 0
    checkpoint: int | None = None


def interrupted_message(position: RunPosition, how: str = "interrupted") -> str:
    """The one line a job prints when Ctrl-C (``how``: "terminated by SIGTERM" for that
    signal) stops it::

        interrupted at step 7; the last complete checkpoint is step 5; continue with --resume

    A checkpoint being written when the interrupt landed is not complete (checkpoints are
    written atomically), so it is never the one named."""
    if position.checkpoint is None:
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
    """Notes that SIGINT or SIGTERM arrived while it is entered (main thread only), then
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
        """Whether the signal was SIGTERM (exit :data:`EXIT_TERMINATED`, not 130)."""
        return self.signum == signal.SIGTERM

    def __enter__(self) -> InterruptWatch:
        # only over the default dispositions (a shell's Ctrl-C: Python's own handler; SIGTERM:
        # death); SIG_IGN and handlers of others are left alone (Ray's driver installs its own
        # SIGTERM handler, which exits through SystemExit)
        if threading.current_thread() is threading.main_thread():
            for signum, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
                if signal.getsignal(signum) is default:
                    signal.signal(signum, self._handle)
                    self._installed.append(signum)
        return self

    def __exit__(self, *exc: object) -> None:
        defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
        for signum in self._installed:
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, defaults[signum])
        self._installed = []
