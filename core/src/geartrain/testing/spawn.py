"""Real multi-process runs for engine tests: ``run_ranks(fn, world)`` spawns ``world``
processes that form one gloo world (a ``FileStore`` in a temporary directory) and returns
what ``fn(rank, world, *args)`` returned on each rank.

Every rank runs with one intra-op thread (several ranks share a small machine). A rank that
raises ends the run with its traceback; a run past ``timeout`` is killed. Results travel
back through files in the run's own temporary directory, written with ``torch.save`` and
read with ``torch.load(weights_only=True)``: tensors, numbers, strings, ``None`` and
lists, tuples and dicts of them; nothing read back is unpickled code."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _entry(rank: int, world: int, store_path: str, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
        # every rank has connected before any may leave: a rank that failed at once and exited
        # closed its sockets while a slower peer was still connecting (gloo's connectFullMesh
        # failed there, torch's spawn then killed the failed rank before its record was written)
        dist.barrier()
        result = fn(rank, world, *args)
        _write(Path(out_dir) / f"rank{rank}.pt", {"ok": True, "result": result})
    except BaseException:
        _write(Path(out_dir) / f"rank{rank}.pt", {"ok": False, "error": traceback.format_exc()})
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


#: the default ``timeout`` of :func:`run_ranks`: a hang guard only (a deadlocked collective
#: would block a suite forever), far above what an engine test's ranks take on a loaded machine
#: (minutes at most), so it never decides a test there
HANG_GUARD_S = 1800.0


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = HANG_GUARD_S) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned gloo processes (``fn`` must be a
    module-level function, its results tensors, numbers, strings, ``None`` and lists, tuples
    and dicts of them); return each rank's result in rank order. Raises ``RuntimeError``
    with the failing ranks' tracebacks, or naming the rank whose result is something else
    (a dataclass, any other object), ``TimeoutError`` (after killing the ranks) past
    ``timeout`` seconds."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        args = (world, os.path.join(tmp, "store"), tmp, fn, args)
        ctx = mp.start_processes(_entry, args=args, nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish in {timeout} s")
        except TimeoutError:
            _kill(ctx)
            raise
        except Exception:  # a rank failed: report every failed rank's traceback
            _kill(ctx)
            records = [_read(f) for f in sorted(Path(tmp).glob("rank*.pt"))]
            details = "\n".join(r["error"] for r in records if not r["ok"])
            raise RuntimeError(f"{fn.__name__} failed on {world} ranks:\n{details}") from None
        finally:
            _remove_error_files(ctx)
        return [_read(Path(tmp) / f"rank{r}.pt", fn.__name__)["result"] for r in range(world)]


def _remove_error_files(ctx: Any) -> None:
    """torch's spawn has a failing rank pickle its traceback to a ``pytorch-errorfile-*``
    file in the system's temporary directory and never removes it (one per failed rank;
    the traceback read here comes from the run's own directory)."""
    for name in ctx.error_files:
        with contextlib.suppress(OSError):
            os.unlink(name)


def _kill(ctx: Any) -> None:
    for process in ctx.processes:
        if process.is_alive():
            process.kill()


def _write(path: Path, record: dict[str, Any]) -> None:
    torch.save(record, path)


def _read(path: Path, fn_name: str = "") -> dict[str, Any]:
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        why = f"it holds a {found.group(1)}" if found else type(exc).__name__
        raise RuntimeError(
            f"{fn_name} on {path.stem.replace('rank', 'rank ')}: the result is not tensors, numbers, strings, "
            f"None and lists, tuples or dicts of them ({why})"
        ) from None
