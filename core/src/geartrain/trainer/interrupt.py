"""What a job says when it is interrupted (Ctrl-C): one line, the same from every
placement (the inline driver here, the Ray driver in :mod:`geartrain.cluster`), and the
exit status a shell expects from SIGINT."""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from geartrain.errors import exception_chain

#: Exit status of a process stopped by SIGINT (128 + 2), what shells and CI report.
EXIT_INTERRUPTED = 130


@dataclass
class RunPosition:
    """Where a job stands, for the interruption message: the RL step in progress (0 before
    the first, during the warm start and the checks) and the newest checkpoint that is
    complete on disk (``None``: none yet)."""

    output_dir: Path
    step: int = 0
    checkpoint: int | None = None


def interrupted_message(position: RunPosition) -> str:
    """The one line a job prints when Ctrl-C stops it::

        interrupted at step 7; the last complete checkpoint is step 5; continue with --resume

    A checkpoint being written when the interrupt landed is not complete (checkpoints are
    written atomically), so it is never the one named."""
    if position.checkpoint is None:
        where = f"no checkpoint was completed in {position.output_dir}; start again with --overwrite"
    else:
        where = f"the last complete checkpoint is step {position.checkpoint}; continue with --resume"
    return f"interrupted at step {position.step}; {where}"


def is_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` is Ctrl-C's ``KeyboardInterrupt`` or was raised because of one: a
    library that catches everything may hand it back wrapped (DCP's ``CheckpointException``
    when the interrupt lands during a checkpoint's save)."""
    return any(isinstance(e, KeyboardInterrupt) for e in exception_chain(exc))


class InterruptWatch:
    """Notes that SIGINT arrived while it is entered (main thread only), then lets
    Python's own handler raise ``KeyboardInterrupt`` as usual. Code that swallows the
    ``KeyboardInterrupt`` and fails otherwise (C++ writing a checkpoint: torch.save's
    zip writer reports "unexpected pos" once a write was cut) still ends as an interrupt:
    :attr:`seen` says one arrived."""

    def __init__(self) -> None:
        self.seen = False
        self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.seen = True
        signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt

    def __enter__(self) -> InterruptWatch:
        # only over Python's own handler (a shell's Ctrl-C); SIG_IGN and others are left alone
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed and signal.getsignal(signal.SIGINT) == self._handle:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        self._installed = False
