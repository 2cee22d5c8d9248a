"""A job's standard output and error when they may stop taking what is written.

The job's lines (the SFT summary, sample tables, the export and metrics paths, the progress
bar) are for whoever reads them; a stream that can no longer be written must not stop the
run, nor be taken for the run directory's own failure. Standard output whose reader left
(``geartrain train ... | head``) or whose file cannot be written (``> run.log`` on a full
disk, an I/O error) goes to ``/dev/null`` from then on and the job goes on, as if it had
never been read; the second case is said once on standard error. Standard error that cannot
be written (``2> /dev/full``) goes to ``/dev/null`` the same way, saying nothing: there is
nowhere left to say it."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO


class _MayStop:
    """Stands for ``stream``; a write or flush that fails (its reader gone, its file
    unwritable) sends the stream to ``/dev/null`` (its file descriptor too, so the
    interpreter's last flush is quiet) and, given ``tell``, says why once through it."""

    def __init__(self, stream: TextIO, tell: Any = None) -> None:
        self._stream = stream
        self._tell = tell
        self.reader_left = False

    def _leave(self, exc: OSError) -> None:
        self.reader_left = True
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        if self._tell is not None and not isinstance(exc, BrokenPipeError):  # a reader that left chose to
            self._tell(
                f"note: standard output cannot be written ({exc.strerror or exc}); "
                "the job goes on without it (its metrics and samples are in the run directory)"
            )

    def write(self, text: str) -> int:
        if self.reader_left:
            return len(text)
        try:
            return self._stream.write(text)
        except OSError as exc:
            self._leave(exc)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            if not self.reader_left:
                self._leave(exc)
            with contextlib.suppress(OSError):
                self._stream.flush()  # what was buffered goes to /dev/null now

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _tell_on_stderr(line: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def reader_may_leave() -> Iterator[None]:
    """Within it, ``sys.stdout`` and ``sys.stderr`` survive a write that fails (see the
    module docstring)."""
    originals = sys.stdout, sys.stderr
    if sys.stderr is not None:
        sys.stderr = _MayStop(sys.stderr)  # type: ignore[assignment]
    if sys.stdout is not None:
        sys.stdout = _MayStop(sys.stdout, tell=_tell_on_stderr)  # type: ignore[assignment]
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
        sys.stdout, sys.stderr = originals
