"""The rollout hooks of the ``sglang`` backend; each delegates to :class:`SglangRollout`.

The hook contracts are in :mod:`geartrain.hookspecs`. ``capabilities`` and
``config_schema`` import nothing heavy; SGLang is imported when an engine starts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from geartrain.config import ModelConfig, RolloutConfig, options_of
from geartrain.hookspecs import hookimpl
from geartrain.types import Capability, EngineContext, MemoryStats, SamplingParams

from geartrain_sglang.options import SglangOptions

if TYPE_CHECKING:
    from geartrain.batch import Batch

    from geartrain_sglang.rollout import SglangRollout


@hookimpl
def capabilities() -> list[str]:
    # lora: update_adapter through SGLang's load_lora_adapter_from_tensors (on CPU its
    # torch_native LoRA backend, with cpu_shims' pinned-memory shim)
    return [Capability.CPU, Capability.CUDA, Capability.TENSOR_PARALLEL, Capability.RELEASE_MEMORY, Capability.LORA]


@hookimpl
def config_schema() -> type[SglangOptions]:
    return SglangOptions


@hookimpl
def build_rollout(config: RolloutConfig, model: ModelConfig, ctx: EngineContext) -> SglangRollout:
    from geartrain_sglang.rollout import SglangRollout

    return SglangRollout(config, model, ctx, options_of(config, SglangOptions))


@hookimpl
def generate(rollout: SglangRollout, prompts: list[list[int]], sampling: SamplingParams) -> Batch:
    return rollout.generate(prompts, sampling)


@hookimpl
def update_weights(rollout: SglangRollout, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    rollout.update_weights(named_tensors)


@hookimpl
def update_adapter(rollout: SglangRollout, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    rollout.update_adapter(name, tensors, config)


@hookimpl
def release(rollout: SglangRollout) -> MemoryStats:
    return rollout.release()


@hookimpl
def resume(rollout: SglangRollout) -> MemoryStats:
    return rollout.resume()


@hookimpl
def shutdown(rollout: SglangRollout) -> None:
    rollout.shutdown()
