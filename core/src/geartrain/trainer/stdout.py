"""A job's standard output when its reader may leave (``geartrain train ... | head``).

The job's lines (the SFT summary, sample tables, the export and metrics paths) are for
whoever reads them; a reader that stops reading must not stop the run. Once a write finds
the pipe closed, standard output goes to ``/dev/null`` and the job goes on, as if its output
had never been read."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO


class _ReaderMayLeave:
    """Stands for ``stream``; a write or flush that finds its reader gone sends the stream to
    ``/dev/null`` (its file descriptor too, so the interpreter's last flush is quiet)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.reader_left = False

    def _leave(self) -> None:
        self.reader_left = True
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._leave()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._leave()
            with contextlib.suppress(OSError):
                self._stream.flush()  # what was buffered goes to /dev/null now

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def reader_may_leave() -> Iterator[None]:
    """Within it, ``sys.stdout`` survives its reader leaving (see the module docstring)."""
    original = sys.stdout
    if original is None:
        yield
        return
    sys.stdout = _ReaderMayLeave(original)  # type: ignore[assignment]
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            sys.stdout.flush()
        sys.stdout = original
