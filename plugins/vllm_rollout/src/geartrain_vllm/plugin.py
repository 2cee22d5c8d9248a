"""The rollout hooks of the ``vllm`` backend; each delegates to :class:`VllmRollout`.

The hook contracts are in :mod:`geartrain.hookspecs`. ``capabilities`` and
``config_schema`` import nothing heavy; vLLM is imported when an engine starts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from geartrain.config import ModelConfig, RolloutConfig, options_of
from geartrain.hookspecs import hookimpl
from geartrain.types import Capability, EngineContext, MemoryStats, SamplingParams

from geartrain_vllm.options import VllmOptions

if TYPE_CHECKING:
    from geartrain.batch import Batch

    from geartrain_vllm.rollout import VllmRollout


@hookimpl
def capabilities() -> list[str]:
    return [
        Capability.CPU,
        Capability.CUDA,
        Capability.TENSOR_PARALLEL,
        Capability.RELEASE_MEMORY,
        Capability.LORA,
        Capability.REPETITION_PENALTY,
        Capability.MIN_P,
    ]


@hookimpl
def config_schema() -> type[VllmOptions]:
    return VllmOptions


@hookimpl
def build_rollout(config: RolloutConfig, model: ModelConfig, ctx: EngineContext) -> VllmRollout:
    from geartrain_vllm.rollout import VllmRollout

    return VllmRollout(config, model, ctx, options_of(config, VllmOptions))


@hookimpl
def generate(rollout: VllmRollout, prompts: list[list[int]], sampling: SamplingParams) -> Batch:
    return rollout.generate(prompts, sampling)


@hookimpl
def update_weights(rollout: VllmRollout, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    rollout.update_weights(named_tensors)


@hookimpl
def update_adapter(rollout: VllmRollout, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    rollout.update_adapter(name, tensors, config)


@hookimpl
def release(rollout: VllmRollout) -> MemoryStats:
    return rollout.release()


@hookimpl
def resume(rollout: VllmRollout) -> MemoryStats:
    return rollout.resume()


@hookimpl
def shutdown(rollout: VllmRollout) -> None:
    rollout.shutdown()
