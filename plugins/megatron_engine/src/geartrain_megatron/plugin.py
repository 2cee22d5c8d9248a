"""The ``megatron`` engine's hook implementations (entry point ``geartrain.engines: megatron``).

Each hook is a thin call into the module that does the work; megatron-core is imported on
first use, so loading the plugin (``capabilities``, ``config_schema``) stays cheap and works
without megatron-core installed.
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
)

if TYPE_CHECKING:
    from geartrain.batch import Batch
    from geartrain.config import EngineConfig, ModelConfig
    from geartrain.types import WeightReceiver

    from geartrain_megatron.engine import MegatronModel
    from geartrain_megatron.options import MegatronOptions


@hookimpl
def capabilities() -> Iterable[str]:
    # No 'lora': megatron-core has no LoRA of its own and this engine adds none, so the core
    # refuses actor.lora here before any rank starts, naming the fsdp engine (docs/lora.md).
    return [
        Capability.CPU,
        Capability.CUDA,
        Capability.DATA_PARALLEL,
        Capability.TENSOR_PARALLEL,
        Capability.PIPELINE_PARALLEL,
        Capability.VALUE_HEAD,
        Capability.HF_EXPORT,
        Capability.OFFLOAD,
        Capability.SUM_PI_SQUARED,
    ]


@hookimpl
def config_schema() -> type[MegatronOptions]:
    from geartrain_megatron.options import MegatronOptions

    return MegatronOptions


@hookimpl
def build_model(config: ModelConfig, ctx: EngineContext) -> torch.nn.Module:
    """The transformers model whose weights ``shard`` maps into megatron's layout."""
    from geartrain.modeling import build_hf_model

    return build_hf_model(config)


@hookimpl
def shard(
    module: torch.nn.Module, config: EngineConfig, model_config: ModelConfig, ctx: EngineContext
) -> MegatronModel:
    from geartrain.config import options_of

    from geartrain_megatron.engine import shard_model
    from geartrain_megatron.options import MegatronOptions

    return shard_model(module, config, options_of(config, MegatronOptions), ctx, value_head=model_config.value_head)


@hookimpl
def data_parallel_coordinates(model: MegatronModel) -> DataParallelCoordinates:
    """Ranks of one TP/PP group (one model replica) share a data-parallel slice."""
    return DataParallelCoordinates(rank=model.layout.dp_rank, size=model.layout.dp)


@hookimpl
def forward_backward(model: MegatronModel, batch: Batch, loss_fn: LossFn | None, forward_only: bool) -> StepOutput:
    from geartrain_megatron import train
    from geartrain_megatron.offload import require_onloaded

    require_onloaded(model, "forward_backward")
    return train.forward_backward(model, batch, loss_fn, forward_only)


@hookimpl
def optimizer_step(model: MegatronModel) -> dict[str, float]:
    from geartrain_megatron.offload import require_onloaded
    from geartrain_megatron.optim import clipped_step

    require_onloaded(model, "optimizer_step")
    if model.optimizer is None:
        raise RuntimeError(f"role '{model.ctx.role}' has no optimizer (optim.lr == 0)")
    metrics = clipped_step(model.optimizer, model.chunks, model.config.optim, model.steps)
    if not metrics["skipped"]:
        model.steps += 1
    return metrics


@hookimpl
def reshard_for_rollout(model: MegatronModel, rollout: WeightReceiver | None) -> SyncStats:
    from geartrain_megatron import weights
    from geartrain_megatron.offload import require_onloaded

    require_onloaded(model, "reshard_for_rollout")
    return weights.reshard_for_rollout(model, rollout)


@hookimpl
def save_checkpoint(model: MegatronModel, path: Path, extra: dict[str, Any]) -> None:
    from geartrain_megatron import checkpoint
    from geartrain_megatron.offload import require_onloaded

    require_onloaded(model, "save_checkpoint")
    checkpoint.save(model, path, extra)


@hookimpl
def load_checkpoint(model: MegatronModel, path: Path) -> dict[str, Any]:
    from geartrain_megatron import checkpoint

    return checkpoint.load(model, path)


@hookimpl
def export_hf(model: MegatronModel, path: Path, tokenizer: Any | None) -> None:
    from geartrain_megatron import weights
    from geartrain_megatron.offload import require_onloaded

    require_onloaded(model, "export_hf")
    weights.export_hf(model, Path(path), tokenizer)


@hookimpl
def offload(model: MegatronModel, what: frozenset[str]) -> MemoryStats:
    from geartrain_megatron import offload as _offload

    return _offload.offload(model, what)


@hookimpl
def onload(model: MegatronModel) -> MemoryStats:
    from geartrain_megatron import offload as _offload

    return _offload.onload(model)
