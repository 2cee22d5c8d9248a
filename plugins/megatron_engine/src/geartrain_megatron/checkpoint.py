"""Sharded checkpoints with megatron's ``dist_checkpointing``.

Layout inside the directory the core hands over (the core makes it atomic): ``dist/``
(model chunks and optimizer state as sharded tensors: a checkpoint saved in one TP/PP
layout loads into another), ``trainer.pt`` (optimizer step count and the caller's
``extra``, written by rank 0) and ``rng/rank_<r>.pt`` (each rank's RNG states, including
megatron's model-parallel RNG tracker).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from geartrain import load_state, save_state

from geartrain_megatron.compat import cpu_compat
from geartrain_megatron.engine import MegatronModel

# the distributed optimizer's state only round-trips through this format with the
# plain-torch Adam that megatron falls back to without Apex/TransformerEngine
_DIST_OPTIM_FORMAT = "dp_reshardable"


def _torch_optimizers(model: MegatronModel) -> list[Any]:
    opt = model.optimizer
    return [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]


def _has_optimizer_state(model: MegatronModel) -> bool:
    """False before the first step: there are no moments to save yet."""
    return model.optimizer is not None and any(len(o.state) for o in _torch_optimizers(model))


def _sharded_state(model: MegatronModel, *, loading: bool, optimizer: bool) -> dict[str, Any]:
    modules = model.modules  # megatron's DDP wrapper would prefix every key with 'module.'
    state: dict[str, Any] = {}
    if len(modules) == 1:
        state["model"] = modules[0].sharded_state_dict()
    else:
        for i, chunk in enumerate(modules):
            state[f"model{i}"] = chunk.sharded_state_dict()
    if optimizer:
        # nested, not merged: chunks share local key names (their layers differ)
        merged = {key: state[key] for key in state if key.startswith("model")}
        metadata = (
            {"distrib_optim_sharding_type": _DIST_OPTIM_FORMAT} if model.options.use_distributed_optimizer else None
        )
        state["optimizer"] = model.optimizer.sharded_state_dict(merged, is_loading=loading, metadata=metadata)
    return state


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    import numpy as np

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    # as a tensor and plain numbers, so the file loads with weights_only=True
    state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def save(model: MegatronModel, path: Path, extra: dict[str, Any]) -> None:
    """Write everything :func:`load` restores into ``path`` (collective)."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    rank = dist.get_rank()
    with cpu_compat():
        (path / "dist").mkdir(parents=True, exist_ok=True)
        # a fresh optimizer (no step yet) is saved as "no optimizer state", so that saving
        # and resuming leave it exactly as fresh as it was
        with_optimizer = _has_optimizer_state(model)
        dist_checkpointing.save(_sharded_state(model, loading=False, optimizer=with_optimizer), str(path / "dist"))
        (path / "rng").mkdir(exist_ok=True)
        save_state(_rng_state(), path / "rng" / f"rank_{rank}.pt")
        if rank == 0:
            layout = model.layout
            save_state(
                {
                    "steps": model.steps,
                    "extra": extra,
                    "layout": (layout.tp, layout.pp, layout.vpp, layout.dp),
                    "optimizer": with_optimizer,
                },
                path / "trainer.pt",
            )
        dist.barrier()


def load(model: MegatronModel, path: Path) -> dict[str, Any]:
    """Restore model, optimizer, schedule position and RNG states in place (resharding
    when the layout differs from the saved one); return ``extra``."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    with cpu_compat():
        trainer = load_state(path / "trainer.pt")  # weights_only: a checkpoint never runs code
        with_optimizer = model.optimizer is not None and trainer.get("optimizer", True)
        state = dist_checkpointing.load(
            _sharded_state(model, loading=True, optimizer=with_optimizer), str(path / "dist")
        )
        if len(model.modules) == 1:
            model.modules[0].load_state_dict(state["model"], strict=True)
        else:
            for i, chunk in enumerate(model.modules):
                chunk.load_state_dict(state[f"model{i}"], strict=True)
        if with_optimizer:
            model.optimizer.load_state_dict(state["optimizer"])
        elif model.optimizer is not None:
            for opt in _torch_optimizers(model):  # saved before the first step: fresh again
                opt.state.clear()
        model.steps = int(trainer["steps"])
        saved_layout = trainer.get("layout")
        layout = model.layout
        rng_file = path / "rng" / f"rank_{dist.get_rank()}.pt"
        # RNG streams belong to ranks of one layout: restore them only into the same one
        if rng_file.exists() and saved_layout == (layout.tp, layout.pp, layout.vpp, layout.dp):
            _set_rng_state(load_state(rng_file))
    return trainer["extra"]
