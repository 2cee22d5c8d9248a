"""Keeping a job's working directory where the job started it.

A run's relative paths (``trainer.output_dir`` first) are resolved against the working
directory whenever a file is opened, so user code that calls ``os.chdir`` (a reward
function, an environment, a callback) would silently move the rest of the run's files
elsewhere, or make a writer thread fail on a path that no longer exists. The job checks
after each call of such code and changes the directory back, saying once which code moved
it."""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger("geartrain")


def _current() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # the directory moved to was removed meanwhile
        return None


class WorkingDirectoryGuard:
    """Remembers the working directory at construction; :meth:`restore` puts it back when
    code has changed it (thread-safe: scoring threads call it too)."""

    def __init__(self) -> None:
        self.start = os.getcwd()
        self._said: set[str] = set()
        self._lock = threading.Lock()

    def restore(self, culprit: str) -> bool:
        """Change back to the starting directory if the working directory is another one now,
        warning once per ``culprit`` (the code just called, e.g. ``"reward function 'f'"``).
        Whether it had changed."""
        now = _current()
        if now == self.start:
            return False
        with self._lock:
            os.chdir(self.start)
            if culprit not in self._said:
                self._said.add(culprit)
                logger.warning(
                    "%s changed the working directory to %s (os.chdir); geartrain changed it back to '%s', against "
                    "which the run's relative paths (trainer.output_dir) are resolved: code a run calls must not "
                    "change the process's working directory (use absolute paths, or a subprocess with cwd=)",
                    culprit,
                    f"'{now}'" if now is not None else "a directory since removed",
                    self.start,
                )
        return True
