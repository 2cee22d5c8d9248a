"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Layout inside the directory the core hands over: ``dcp/`` (model + optimizer, sharded;
each rank writes its shards), ``trainer.pt`` (LR scheduler and the caller's ``extra``,
written by rank 0) and ``rng/rank_<r>.pt`` (each rank's RNG states).
"""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from geartrain_fsdp.sharding import FSDPModel


def _rank(model: FSDPModel) -> int:
    return dist.get_rank(model.meshes.ctx_group) if model.meshes.distributed else 0


def _app_state(model: FSDPModel) -> dict[str, Any]:
    state: dict[str, Any] = {"model": get_model_state_dict(model.module)}
    if model.optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model.module, model.optimizer)
    return state


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy ships with torch's deps here
        pass
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    # One rank without a process group is a supported mode here; DCP warns about it on
    # every call, which would flood the training console.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save(model: FSDPModel, path: Path, extra: dict[str, Any]) -> None:
    """Write everything :func:`load` restores into ``path`` (collective)."""
    path = Path(path)
    with _single_process_is_intended():
        dcp.save(_app_state(model), checkpoint_id=str(path / "dcp"), process_group=model.meshes.ctx_group)
    rank = _rank(model)
    (path / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), path / "rng" / f"rank_{rank}.pt")
    if rank == 0:
        trainer = {
            "scheduler": model.scheduler.state_dict() if model.scheduler is not None else None,
            "extra": extra,
            "world": model.meshes.world,
        }
        torch.save(trainer, path / "trainer.pt")


def load(model: FSDPModel, path: Path) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG states in place; return ``extra``."""
    path = Path(path)
    state = _app_state(model)
    with _single_process_is_intended():
        dcp.load(state, checkpoint_id=str(path / "dcp"), process_group=model.meshes.ctx_group)
    set_model_state_dict(model.module, state["model"])
    if model.optimizer is not None:
        set_optimizer_state_dict(model.module, model.optimizer, state["optim"])
    trainer = torch.load(path / "trainer.pt", weights_only=False)
    if model.scheduler is not None and trainer["scheduler"] is not None:
        model.scheduler.load_state_dict(trainer["scheduler"])
    rng_file = path / "rng" / f"rank_{_rank(model)}.pt"
    if rng_file.exists():  # absent when resuming on more ranks than saved
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return trainer["extra"]
