"""Atomic, retained checkpoint directories.

Layout under a checkpoint root::

    root/step_00000010/            a complete checkpoint (has COMPLETE)
    root/step_00000010/COMPLETE    json marker, written last
    root/.partial-step_00000020/   a save in progress (or one that was killed)

A save writes into ``.partial-*``, then rank 0 writes the marker and renames the directory
into place, so a save interrupted at any point leaves the previous checkpoint the newest
loadable one. Only the newest ``keep_last`` complete checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from geartrain.errors import CheckpointError

MARKER = "COMPLETE"
_PREFIX = "step_"
_PARTIAL = ".partial-"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


class CheckpointManager:
    """Saves into ``root`` atomically and finds the newest complete checkpoint."""

    def __init__(self, root: str | Path, keep_last: int = 2) -> None:
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1")
        self.root = Path(root)
        self.keep_last = keep_last

    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        """Call ``write(tmp_dir)`` on every rank, then publish ``tmp_dir`` as the checkpoint
        of ``step``. Returns the published path."""
        final = self.root / step_dir_name(step)
        partial = self.root / f"{_PARTIAL}{step_dir_name(step)}"
        if _is_rank0():
            self.root.mkdir(parents=True, exist_ok=True)
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir()
        _barrier()
        write(partial)
        _barrier()
        if _is_rank0():
            marker = partial / MARKER
            with open(marker, "w") as fh:
                json.dump({"step": step, "time": time.time()}, fh)
                fh.flush()
                os.fsync(fh.fileno())
            if final.exists():
                shutil.rmtree(final)
            os.replace(partial, final)
            _fsync_dir(self.root)
            self._prune()
        _barrier()
        return final

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.exists():
            return []
        found = [p for p in self.root.iterdir() if p.name.startswith(_PREFIX) and (p / MARKER).exists()]
        return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or ``None``."""
        done = self.complete()
        return done[-1] if done else None

    @staticmethod
    def step_of(path: Path) -> int:
        return int(Path(path).name[len(_PREFIX):])

    @staticmethod
    def check_complete(path: str | Path) -> Path:
        """``path`` if it is a complete checkpoint, else a :class:`CheckpointError`."""
        path = Path(path)
        if not (path / MARKER).exists():
            raise CheckpointError(f"{path} is not a complete checkpoint (no {MARKER} marker): it was cut off mid-write or is not a geartrain checkpoint")
        return path

    def _prune(self) -> None:
        done = self.complete()
        for old in done[: max(0, len(done) - self.keep_last)]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(f"{_PARTIAL}*"):
            shutil.rmtree(stale, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
