"""The lock by which a live run owns its output directory.

A job holds ``<output_dir>/.geartrain.lock`` for its whole life: an ``flock`` on the
file (released by the kernel when the process ends, however it ends) plus a line of JSON
naming the owner (host, pid, start time, command) so a refusal can say which run holds the
directory. A fresh run, ``--resume`` and ``--overwrite`` all take it before they change
anything, so a second job into a directory whose run is still going is refused in one line
and deletes nothing.

A lock file whose ``flock`` nobody holds is stale (its process is gone: killed, crashed,
or its node lost): the next job takes it over and says whose it was. The file is never
deleted (deleting it would let two jobs lock two different files of one name); a job that
ends cleanly empties it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from geartrain.errors import GeartrainError

LOCK_NAME = ".geartrain.lock"


class RunLockedError(GeartrainError):
    """The output directory is held by a live run."""


@dataclass(frozen=True)
class LockOwner:
    """Who holds (or last held) a run directory's lock."""

    host: str
    pid: int
    started: float
    command: str

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"pid {self.pid} on host {self.host}, started {when}: {self.command}"

    @staticmethod
    def me() -> LockOwner:
        return LockOwner(socket.gethostname(), os.getpid(), time.time(), " ".join(sys.argv) or "python")


def _read_owner(fd: int) -> LockOwner | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while chunk := os.read(fd, 65536):
        raw += chunk
    try:
        data = json.loads(raw.decode("utf-8"))
        return LockOwner(str(data["host"]), int(data["pid"]), float(data["started"]), str(data["command"]))
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _refusal(directory: Path, owner: LockOwner | None) -> RunLockedError:
    who = owner.describe() if owner is not None else "its owner did not record itself yet"
    return RunLockedError(
        f"trainer.output_dir '{directory}' is in use by a live run ({who}); nothing was changed. "
        "Wait for that run to end (or stop it), or choose another trainer.output_dir"
    )


def held(directory: str | Path) -> tuple[bool, LockOwner | None]:
    """Whether a live run holds ``directory``, and who (``None`` while the owner has not
    recorded itself yet). Changes nothing (no lock file is created where there is none)."""
    path = Path(directory) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)  # flock needs no write access (a read-only filesystem)
    except OSError:
        return False, None  # none there; or one we cannot open (the writability checks name that)
    try:
        if not _try_flock(fd):
            return True, _read_owner(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False, None
    finally:
        os.close(fd)


def probe(directory: str | Path) -> None:
    """Raise :class:`RunLockedError` if a live run holds ``directory``. Changes nothing."""
    live, owner = held(directory)
    if live:
        raise _refusal(Path(directory), owner)


class RunLock:
    """The held lock of one run directory; :meth:`release` (or process exit) frees it."""

    def __init__(self, directory: Path, fd: int, previous: LockOwner | None) -> None:
        self.directory = directory
        self._fd: int | None = fd
        #: the owner of a stale lock this one took over (``None``: the lock was free)
        self.previous = previous

    @classmethod
    def acquire(cls, directory: str | Path) -> RunLock:
        """Take ``directory``'s lock (the directory must exist) or raise
        :class:`RunLockedError` naming the live run that holds it."""
        directory = Path(directory)
        try:
            fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:  # read-only filesystem, permissions, quota
            raise RunLockedError(
                f"trainer.output_dir '{directory}': cannot create its lock file {LOCK_NAME} "
                f"({exc.strerror or exc}); nothing was changed. Choose a writable trainer.output_dir"
            ) from None
        try:
            if not _try_flock(fd):
                raise _refusal(directory, _read_owner(fd))
            previous = _read_owner(fd)
            me = LockOwner.me()
            record = json.dumps({"host": me.host, "pid": me.pid, "started": me.started, "command": me.command}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, record + b"\n", 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(directory, fd, previous)

    def stale_note(self) -> str | None:
        """A line about the stale lock taken over, if there was one."""
        if self.previous is None:
            return None
        return f"took over the lock of {self.directory} left by a run that is gone ({self.previous.describe()})"

    def release(self) -> None:
        """Empty the lock file and free the lock (idempotent)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        finally:
            os.close(fd)  # closing the last descriptor drops the flock
