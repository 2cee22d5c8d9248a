"""The ``fsdp`` engine's hook implementations (entry point ``geartrain.engines: fsdp``).

Each hook is a thin call into the module that does the work; heavy imports happen on
first use so that loading the plugin (``capabilities``, ``config_schema``) stays cheap.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from geartrain.hookspecs import hookimpl
from geartrain.types import (
    Capability,
    DataParallelCoordinates,
    EngineContext,
    LossFn,
    MemoryStats,
    StepOutput,
    SyncStats,
    WeightReceiver,
)

if TYPE_CHECKING:
    from geartrain.batch import Batch
    from geartrain.config import EngineConfig, ModelConfig

    from geartrain_fsdp.options import FSDPOptions
    from geartrain_fsdp.sharding import FSDPModel


@hookimpl
def capabilities() -> Iterable[str]:
    return [
        Capability.CPU,
        Capability.CUDA,
        Capability.DATA_PARALLEL,
        Capability.SEQUENCE_PARALLEL,
        Capability.OFFLOAD,
        Capability.VALUE_HEAD,
        Capability.HF_EXPORT,
        Capability.LORA,
        Capability.SUM_PI_SQUARED,
    ]


@hookimpl
def config_schema() -> type[FSDPOptions]:
    from geartrain_fsdp.options import FSDPOptions

    return FSDPOptions


@hookimpl
def build_model(config: ModelConfig, ctx: EngineContext) -> torch.nn.Module:
    """Checkpoint (``path``) models are built empty on the meta device on ranks > 0 of a
    distributed group; ``shard`` then broadcasts rank 0's weights. Tiny models are built
    everywhere from their seed."""
    from geartrain.modeling import build_hf_model

    meta = config.path is not None and ctx.world_size > 1 and ctx.rank != 0
    return build_hf_model(config, meta=meta)


@hookimpl
def shard(module: torch.nn.Module, config: EngineConfig, model_config: ModelConfig, ctx: EngineContext) -> FSDPModel:
    from geartrain.config import options_of

    from geartrain_fsdp.options import FSDPOptions
    from geartrain_fsdp.sharding import shard_model

    return shard_model(
        module,
        config,
        options_of(config, FSDPOptions),
        ctx,
        value_head=model_config.value_head,
        model_config=model_config,
    )


@hookimpl
def data_parallel_coordinates(model: FSDPModel) -> DataParallelCoordinates:
    return DataParallelCoordinates(rank=model.meshes.dp_rank, size=model.meshes.dp)


@hookimpl
def forward_backward(model: FSDPModel, batch: Batch, loss_fn: LossFn | None, forward_only: bool) -> StepOutput:
    from geartrain_fsdp import train

    return train.forward_backward(model, batch, loss_fn, forward_only)


@hookimpl
def optimizer_step(model: FSDPModel) -> dict[str, float]:
    from geartrain.optim import clipped_step

    if model.optimizer is None or model.scheduler is None:
        raise RuntimeError(f"role '{model.ctx.role}' has no optimizer (optim.lr == 0)")
    return clipped_step(model.params(), model.optimizer, model.scheduler, model.config.optim.clip_grad).metrics()


@hookimpl
def reshard_for_rollout(model: FSDPModel, rollout: WeightReceiver | None) -> SyncStats:
    from geartrain_fsdp import weights

    return weights.reshard_for_rollout(model, rollout)


@hookimpl
def save_checkpoint(model: FSDPModel, path: Path, extra: dict[str, Any]) -> None:
    from geartrain_fsdp import checkpoint

    checkpoint.save(model, path, extra)


@hookimpl
def load_checkpoint(model: FSDPModel, path: Path) -> dict[str, Any]:
    from geartrain_fsdp import checkpoint

    return checkpoint.load(model, path)


@hookimpl
def export_hf(model: FSDPModel, path: Path, tokenizer: Any | None) -> None:
    from geartrain_fsdp import weights

    weights.export_hf(model, Path(path), tokenizer)


@hookimpl
def offload(model: FSDPModel, what: frozenset[str]) -> MemoryStats:
    from geartrain_fsdp import offload as _offload

    return _offload.offload(model, what)


@hookimpl
def onload(model: FSDPModel) -> MemoryStats:
    from geartrain_fsdp import offload as _offload

    return _offload.onload(model)
