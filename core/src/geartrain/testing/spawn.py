"""Real multi-process runs for engine tests: ``run_ranks(fn, world)`` spawns ``world``
processes that form one gloo world (a ``FileStore`` in a temporary directory) and returns
what ``fn(rank, world, *args)`` returned on each rank.

Every rank runs with one intra-op thread (several ranks share a small machine). A rank that
raises ends the run with its traceback; a run past ``timeout`` is killed. Results travel
back pickled through files in the run's own temporary directory (written by its ranks only)."""

from __future__ import annotations

import os
import pickle
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
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        _write(Path(out_dir) / f"rank{rank}.pkl", {"ok": True, "result": result})
    except BaseException:
        _write(Path(out_dir) / f"rank{rank}.pkl", {"ok": False, "error": traceback.format_exc()})
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned gloo processes (``fn`` must be a
    module-level function, its results picklable); return each rank's result in rank
    order. Raises ``RuntimeError`` with the failing ranks' tracebacks, ``TimeoutError``
    (after killing the ranks) past ``timeout`` seconds."""
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
            records = [_read(f) for f in sorted(Path(tmp).glob("rank*.pkl"))]
            details = "\n".join(r["error"] for r in records if not r["ok"])
            raise RuntimeError(f"{fn.__name__} failed on {world} ranks:\n{details}") from None
        return [_read(Path(tmp) / f"rank{r}.pkl")["result"] for r in range(world)]


def _kill(ctx: Any) -> None:
    for process in ctx.processes:
        if process.is_alive():
            process.kill()


def _write(path: Path, record: dict[str, Any]) -> None:
    with path.open("wb") as f:
        pickle.dump(record, f)


def _read(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        return pickle.load(f)  # noqa: S301 - written by this run's own ranks
