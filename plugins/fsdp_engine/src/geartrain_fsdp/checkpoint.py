"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Layout inside the directory the core hands over: ``dcp/`` (model + optimizer, sharded;
each rank writes its shards), ``trainer.pt`` (LR scheduler and the caller's ``extra``,
written by rank 0) and ``rng/rank_<r>.pt`` (each rank's RNG states). ``trainer.pt`` and the
RNG files hold only tensors and plain containers and are read back with
:func:`geartrain.load_state` (``weights_only=True``); DCP's ``.metadata`` pickle and its
non-tensor values are read with the core's allow-lists (:func:`geartrain.safe_dcp_reader`,
:func:`geartrain.safe_load_planner`): a checkpoint never runs code.
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
from geartrain import load_state, safe_dcp_reader, safe_load_planner, save_state
from geartrain.errors import CheckpointError
from geartrain.optim import load_scheduler_state
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from geartrain_fsdp.sharding import FSDPModel


def _rank(model: FSDPModel) -> int:
    return dist.get_rank(model.meshes.ctx_group) if model.meshes.distributed else 0


def _app_state(model: FSDPModel) -> dict[str, Any]:
    """Model and optimizer state for DCP. An optimizer that has not stepped yet has no state;
    ``get_optimizer_state_dict`` then creates it by running a step with zero gradients,
    which would start AdamW's step count (its bias correction) one step early. So a fresh
    optimizer is put back to fresh afterwards (see :func:`_untouched`)."""
    weights = get_model_state_dict(model.module, options=_model_options(model))
    if model.peft is not None:
        # a tied output layer escapes ignore_frozen_params (it is not among named_parameters)
        weights = {name: t for name, t in weights.items() if ".lora_" in name}
    state: dict[str, Any] = {"model": weights}
    if model.optimizer is not None:
        with _untouched(model.optimizer):
            state["optim"] = get_optimizer_state_dict(model.module, model.optimizer)
    return state


def _model_options(model: FSDPModel, **kwargs: Any) -> StateDictOptions:
    """LoRA: only the trainable adapters are saved; the frozen base is referenced by path
    and fingerprint (``trainer.pt``), never copied into the checkpoint."""
    return StateDictOptions(ignore_frozen_params=model.peft is not None, **kwargs)


def _lora_record(model: FSDPModel) -> dict[str, Any] | None:
    if model.peft is None:
        return None
    assert model.config.lora is not None
    return {"base": model.base, "base_sha256": model.base_hash, "config": model.config.lora.model_dump()}


def _check_lora(model: FSDPModel, saved: dict[str, Any] | None, path: Path) -> None:
    """Refuse a checkpoint whose adapters were trained on another base (or none)."""
    from geartrain.errors import CheckpointError

    mine = _lora_record(model)
    if (saved is None) != (mine is None):
        what = "LoRA adapters only" if saved is not None else "a full model, no LoRA adapters"
        want = "LoRA adapters (actor.lora)" if mine is not None else "a full model"
        raise CheckpointError(
            f"{path} holds {what}, but this engine trains {want}; resume with the configuration it was saved with"
        )
    if saved is None or mine is None:
        return
    if saved["base_sha256"] != mine["base_sha256"]:
        raise CheckpointError(
            f"{path}: its LoRA adapters were trained on base '{saved['base']}' "
            f"(sha256 {saved['base_sha256'][:12]}...), but this engine's base '{mine['base']}' "
            f"has sha256 {mine['base_sha256'][:12]}...: the base model changed; resume on the base the run started from"
        )
    if (
        saved["config"]["rank"] != mine["config"]["rank"]
        or saved["config"]["target_modules"] != mine["config"]["target_modules"]
    ):
        raise CheckpointError(
            f"{path}: its adapters have rank {saved['config']['rank']} on {saved['config']['target_modules']}, "
            f"this engine's rank {mine['config']['rank']} on {mine['config']['target_modules']}; "
            "resume with the saved actor.lora"
        )


@contextlib.contextmanager
def _untouched(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Leave an optimizer that has no state (it never stepped) without state again."""
    fresh = not optimizer.state
    try:
        yield
    finally:
        if fresh:
            optimizer.state.clear()


def _optimizer_fresh(model: FSDPModel) -> bool:
    return model.optimizer is not None and not model.optimizer.state


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        # as a tensor and plain numbers, so the file loads with weights_only=True
        state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
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

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


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
    fresh = _optimizer_fresh(model)
    with _single_process_is_intended():
        dcp.save(_app_state(model), checkpoint_id=str(path / "dcp"), process_group=model.meshes.ctx_group)
    rank = _rank(model)
    (path / "rng").mkdir(exist_ok=True)
    save_state(_rng_state(), path / "rng" / f"rank_{rank}.pt")
    if rank == 0:
        trainer = {
            "scheduler": model.scheduler.state_dict() if model.scheduler is not None else None,
            "extra": extra,
            "world": model.meshes.world,
            "optimizer_fresh": fresh,
            "lora": _lora_record(model),
        }
        save_state(trainer, path / "trainer.pt")


def _state_mismatch(exc: BaseException) -> str | None:
    """The line of a DCP load error that says the saved state lacks an entry the model has,
    or holds one of another shape (``None``: the error is another kind). A
    ``CheckpointException`` (a ``BaseException``) holds each rank's error in ``failures``."""
    failures = getattr(exc, "failures", None)
    inner = [f[0] if isinstance(f, tuple) else f for f in failures.values()] if isinstance(failures, dict) else []
    for line in "\n".join(str(e) for e in [*inner, exc]).splitlines():  # a rank's own error before DCP's summary
        line = line.strip()
        if "Missing key in checkpoint state_dict" in line or "Size mismatch" in line or "size mismatch" in line:
            return line.rstrip(".")[:300]
    return None


def load(model: FSDPModel, path: Path) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG states in place; return ``extra``."""
    path = Path(path)
    trainer = load_state(path / "trainer.pt")
    _check_lora(model, trainer.get("lora"), path)
    state = _app_state(model)
    try:
        with _single_process_is_intended():
            dcp.load(
                state,
                storage_reader=safe_dcp_reader(path / "dcp"),
                planner=safe_load_planner(),
                process_group=model.meshes.ctx_group,
            )
    except (Exception, CheckpointException) as exc:  # DCP's own errors: RuntimeErrors, in a CheckpointException
        why = _state_mismatch(exc)
        if why is None:
            raise
        raise CheckpointError(
            f"{path}: its model and optimizer state (dcp/) does not fit the model this job builds ({why}): it was "
            "saved from another model or configuration, or edited; resume or export from another checkpoint"
        ) from None
    set_model_state_dict(model.module, state["model"], options=_model_options(model, strict=model.peft is None))
    if model.optimizer is not None:
        set_optimizer_state_dict(model.module, model.optimizer, state["optim"])
        if trainer.get("optimizer_fresh", False):  # saved before the first step: resume fresh
            model.optimizer.state.clear()
    if model.scheduler is not None and trainer["scheduler"] is not None:
        load_scheduler_state(model.scheduler, trainer["scheduler"])
    rng_file = path / "rng" / f"rank_{_rank(model)}.pt"
    if rng_file.exists():  # absent when resuming on more ranks than saved
        _set_rng_state(load_state(rng_file))
    return trainer["extra"]
