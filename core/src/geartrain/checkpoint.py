"""Atomic, retained checkpoint directories.

Layout under a checkpoint root::

    root/step_00000010/               a complete checkpoint (has COMPLETE)
    root/step_00000010/MANIFEST.json  size + SHA-256 of every file the backend wrote
    root/step_00000010/COMPLETE       json marker, written last
    root/.partial-step_00000020/   a save in progress (or one that was killed)

A save writes into ``.partial-*``, then rank 0 writes the marker and renames the directory
into place, so a save interrupted at any point leaves the previous checkpoint the newest
loadable one. Only the newest ``keep_last`` complete checkpoints are kept.

Before a checkpoint is loaded its files are checked against its manifest
(:mod:`geartrain.manifest`): :meth:`CheckpointManager.check_complete` raises a
:class:`CheckpointError` naming the damaged file, and :meth:`CheckpointManager.latest_intact`
skips damaged checkpoints, saying so. :func:`save_state` / :func:`load_state` are the
``torch.save`` / ``torch.load`` pair for a backend's non-tensor state: loading never unpickles
anything but tensors and plain containers (``weights_only=True``), so a checkpoint cannot run
code.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from geartrain.errors import CheckpointError, GeartrainError, exception_chain, unpickling_reason
from geartrain.manifest import verify_manifest, write_manifest

MARKER = "COMPLETE"
_PREFIX = "step_"
_PARTIAL = ".partial-"
_NOT_IN_MANIFEST = frozenset({MARKER})  # written after the manifest; read only for its existence


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
        full = False
        try:
            write(partial)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if not full_disk_error(exc, self.root):
                raise
            full = True  # raised below, once the failed writer's frames (and open files) are gone
        if full:
            self._disk_full(step, partial)
        _barrier()
        if _is_rank0():
            try:
                write_manifest(partial, exclude=_NOT_IN_MANIFEST)
                marker = partial / MARKER
                with open(marker, "w") as fh:
                    json.dump({"step": step, "time": time.time()}, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
            except BaseException as exc:
                if not full_disk_error(exc, self.root):
                    raise
                full = True
            if full:
                self._disk_full(step, partial)
            if final.exists():
                shutil.rmtree(final)
            os.replace(partial, final)
            _fsync_dir(self.root)
            self._prune()
        _barrier()
        return final

    def _disk_full(self, step: int, partial: Path) -> None:
        """Raise the one :class:`DiskFullError` line for a save that failed because the
        disk is full (whatever form the writer's error took: ``OSError(ENOSPC)``, a zip
        writer's ``unexpected pos``, DCP's wrapped failure, see :func:`disk_is_full`). The
        partial save is removed to give the space back; complete checkpoints are not
        touched."""
        shutil.rmtree(partial, ignore_errors=True)
        last = self.latest()
        if last is None:  # nothing to resume (after an --overwrite, the previous run is put back): start again
            raise DiskFullError(
                f"{no_space_on(self.root)} while saving step {step}; no checkpoint was completed in "
                f"{self.root}. Free space there, then start again with --overwrite"
            )
        raise DiskFullError(
            f"{no_space_on(self.root)} while saving step {step}; the last complete checkpoint is step "
            f"{self.step_of(last)} ({last}). Free space there (or lower trainer.keep_last), then continue with --resume"
        )

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.exists():
            return []
        found = [p for p in self.root.iterdir() if p.name.startswith(_PREFIX) and (p / MARKER).exists()]
        return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))

    def incomplete(self, newer_than: Path | None = None) -> list[Path]:
        """Step directories (``step_N``) without the marker, newest first, only those of a
        later step than ``newer_than`` when given: a save cut off outside the partial
        directory, or a checkpoint whose marker was removed. Partial saves are not listed."""
        if not self.root.exists():
            return []
        floor = self.step_of(newer_than) if newer_than is not None else -1
        found = [
            p
            for p in self.root.iterdir()
            if p.is_dir()
            and p.name.startswith(_PREFIX)
            and p.name[len(_PREFIX) :].isdigit()
            and not (p / MARKER).exists()
            and self.step_of(p) > floor
        ]
        return sorted(found, key=self.step_of, reverse=True)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or ``None``."""
        done = self.complete()
        return done[-1] if done else None

    def latest_intact(
        self, echo: Callable[[str], None] = print, *, also: Callable[[Path], list[str]] | None = None
    ) -> Path | None:
        """The newest complete checkpoint whose files match its manifest (and for which
        ``also(path)``, e.g. the same step of another role, reports no problem). Each
        damaged checkpoint passed over is reported through ``echo``, naming the file.
        Raises :class:`CheckpointError` when checkpoints exist but none is intact."""
        done = self.complete()
        for path in self.incomplete(newer_than=done[-1] if done else None):
            older = "falling back to the newest complete one" if done else "no complete checkpoint is left"
            echo(
                f"checkpoint {path} is damaged: it has no {MARKER} marker (cut off mid-write, or the marker was "
                f"removed); {older}"
            )
        for path in reversed(done):
            problems = verify_manifest(path, exclude=_NOT_IN_MANIFEST) or misnamed(path)
            problems += also(path) if also is not None else []
            if not problems:
                return path
            older = "falling back to the previous checkpoint" if path != done[0] else "no older checkpoint is left"
            echo(f"checkpoint {path} is damaged: {'; '.join(problems)}; {older}")
        if done:
            raise CheckpointError(
                f"every checkpoint under {self.root} is damaged (see above); start a fresh run with --overwrite, "
                "or restore the files from a copy"
            )
        return None

    @staticmethod
    def step_of(path: Path) -> int:
        return int(Path(path).name[len(_PREFIX) :])

    @staticmethod
    def check_complete(path: str | Path) -> Path:
        """``path`` if it is a complete checkpoint whose files match its manifest, else a
        :class:`CheckpointError` naming the checkpoint and the damaged file."""
        path = Path(path)
        if not (path / MARKER).exists():
            raise CheckpointError(
                f"{path} is not a complete checkpoint (no {MARKER} marker): it was cut off mid-write "
                "or is not a geartrain checkpoint"
            )
        problems = verify_manifest(path, exclude=_NOT_IN_MANIFEST) or misnamed(path)
        if problems:
            raise CheckpointError(f"checkpoint {path} is damaged: {'; '.join(problems)}")
        return path

    def _prune(self) -> None:
        done = self.complete()
        for old in done[: max(0, len(done) - self.keep_last)]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(f"{_PARTIAL}*"):
            shutil.rmtree(stale, ignore_errors=True)


def misnamed(path: Path) -> list[str]:
    """``[problem]`` when the step an engine recorded in checkpoint ``path`` (its
    ``engine.json``, covered by the manifest) is not the step its directory is named after
    (a renamed or copied-over directory: resuming by its name would count steps wrongly and
    rank it wrongly among the others), else ``[]``. A checkpoint without the record passes."""
    try:
        recorded = json.loads((Path(path) / "engine.json").read_text(encoding="utf-8")).get("step")
    except (OSError, ValueError, AttributeError):
        return []
    try:
        named = CheckpointManager.step_of(path)
    except ValueError:  # a copy named otherwise ('best'): its name claims no step to contradict
        return []
    if isinstance(recorded, int) and recorded != named:
        return [f"engine.json records step {recorded}, not {named}: the directory was renamed or copied over"]
    return []


def save_state(state: Any, path: str | Path) -> None:
    """``torch.save`` of tensors and plain containers (dict, list, tuple, str, int, float,
    bool, None) that :func:`load_state` reads back."""
    torch.save(state, path)


def load_state(path: str | Path, map_location: Any = None) -> Any:
    """Read a file written by :func:`save_state` without running code from it
    (``torch.load(weights_only=True)``). Anything else in the file (a pickled class, a
    ``__reduce__`` payload) raises :class:`CheckpointError` naming the file; nothing in
    it is executed."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        first = unpickling_reason(exc)
        raise CheckpointError(
            f"{path}: refusing to load it: it holds objects other than tensors and plain containers "
            f"({first}); geartrain never unpickles code from a checkpoint"
        ) from None


class DiskFullError(CheckpointError):
    """A save ran out of disk space."""


#: below this many free bytes a failed write is taken to be a full disk
_FULL_BELOW = 1 << 20


def file_size_limit() -> int | None:
    """This process's file size limit in bytes (``ulimit -f``; a write past it fails with
    EFBIG, as Python ignores SIGXFSZ), or ``None`` when there is none."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def _a_file_at(where: Path, size: int) -> bool:
    """Whether a file under ``where`` (or ``where`` itself) has at least ``size`` bytes."""
    try:
        files = [where] if where.is_file() else where.rglob("*")
        return any(f.is_file() and f.stat().st_size >= size for f in files)
    except OSError:
        return False


def no_space_on(where: str | Path) -> str:
    """How a failed write for want of space under ``where`` is said: ``no space left on
    <device>``, naming the file size limit too when the process has one."""
    said = f"no space left on {device_of(where)}"
    limit = file_size_limit()
    if limit is not None:
        said += f" (or this process's file size limit, ulimit -f, of {limit} bytes reached)"
    return said


def disk_is_full(exc: BaseException, where: str | Path) -> bool:
    """Whether ``exc`` (raised while writing under ``where``) is a full disk: an ENOSPC (or
    a used-up quota, EDQUOT, or the file size limit, EFBIG) in its chain; or, as writers
    that lose the errno leave it, a file under ``where`` stopped at the process's file size
    limit, or almost no space left there (an ``OSError`` with another errno in the chain, or
    a file system without blocks such as ``/proc``, is not one)."""
    chain = list(exception_chain(exc))
    for e in chain:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return True
        if any(text in str(e) for text in ("No space left on device", "Disk quota exceeded", "File too large")):
            return True  # the strerror of ENOSPC, EDQUOT, EFBIG in a writer's own error (safetensors')
    if any(isinstance(e, OSError) and e.errno is not None for e in chain):
        return False  # an error that says its own cause (no such directory, permission denied, ...)
    limit = file_size_limit()
    if limit is not None and _a_file_at(Path(where), limit):
        return True  # a writer that lost the errno under ``ulimit -f``: a file stopped at the limit
    try:
        stat = os.statvfs(Path(where))
    except OSError:
        return False
    return stat.f_blocks > 0 and stat.f_bavail * stat.f_frsize < _FULL_BELOW  # no blocks: a pseudo file system


def full_disk_error(exc: BaseException, where: str | Path) -> bool:
    """Whether ``exc``, raised by a write under ``where``, is to be reported as a full disk:
    any form of it (an ``OSError``, a writer's own message, DCP's ``CheckpointException`` --
    a ``BaseException`` -- wrapping it), but never Ctrl-C or an exit (``KeyboardInterrupt``,
    ``SystemExit``, also as DCP wraps them), which go on as they are."""
    if any(isinstance(e, KeyboardInterrupt | SystemExit) for e in exception_chain(exc)):
        return False
    if not isinstance(exc, Exception) and type(exc).__name__ != "CheckpointException":
        return False  # GeneratorExit and the like
    return disk_is_full(exc, where)


def export_disk_full(exc: BaseException, path: Path, source: str | Path) -> DiskFullError | None:
    """The one-line :class:`DiskFullError` for an export of ``source`` (a checkpoint or a
    run) into ``path`` that failed because the disk is full (``None``: it failed otherwise);
    the partial export is removed first."""
    if not full_disk_error(exc, path.parent if not path.exists() else path):
        return None
    shutil.rmtree(path, ignore_errors=True)
    return DiskFullError(
        f"{no_space_on(path.parent)} while exporting the model to {path} (the partial export was "
        f"removed; the checkpoints are untouched); free space there, then: geartrain export {source} {path}"
    )


def run_disk_full(exc: BaseException, output_dir: Path, checkpoint: int | None) -> DiskFullError | None:
    """The one-line :class:`DiskFullError` for a job that failed because the disk of its
    output directory is full while it wrote anything of its own there (``metrics.jsonl``,
    TensorBoard logs, ``completions.jsonl``, the warm start's model, the curves); ``None``:
    it failed otherwise. ``checkpoint`` is the newest complete one (``None``: none)."""
    if isinstance(exc, GeartrainError) or not full_disk_error(exc, output_dir if output_dir.exists() else "."):
        return None
    kept = (
        f"the last complete checkpoint is step {checkpoint}; free space there, then continue with --resume"
        if checkpoint is not None
        else "no checkpoint was completed; free space there, then start again with --overwrite"
    )
    where = f"{no_space_on(output_dir)} while writing the run's files in {output_dir}"
    return DiskFullError(f"{where}; {kept}")


def device_of(path: str | Path) -> str:
    """The filesystem ``path`` is on, as ``DEVICE (mounted at MOUNT)`` (best effort)."""
    target = os.path.realpath(path)
    best = ("", "?")
    try:
        with open("/proc/self/mounts", encoding="utf-8") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) < 2:
                    continue
                source, mount = fields[0], fields[1].replace("\\040", " ")
                if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[0]):
                    best = (mount, source)
    except OSError:
        return target
    return f"{best[1]} (mounted at {best[0]})" if best[0] else target


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
