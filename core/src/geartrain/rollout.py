"""The core's handle on one rollout (inference) instance."""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from geartrain import plugins
from geartrain.batch import Batch
from geartrain.cluster.process_group import release_single_rank_group, with_process_group
from geartrain.config import ModelConfig, RolloutConfig, backend_config_errors, options_of, section_path
from geartrain.errors import GeartrainError
from geartrain.layout import READY_AT
from geartrain.modeling import torch_dtype
from geartrain.types import EngineContext, MemoryStats, SamplingParams, WeightReceiver

__all__ = ["READY_AT", "Rollout", "WeightReceiver", "wait_until"]


def wait_until(when: float) -> None:
    """Sleep until ``time.time()`` reaches ``when`` (at once if it has)."""
    delay = when - time.time()
    if delay > 0:
        time.sleep(delay)


class Rollout:
    """One rollout backend instance: a plugin manager holding exactly that backend (plus
    the enabled extensions) and the backend's handle. Every method is one hook call."""

    def __init__(self, config: RolloutConfig, model: ModelConfig, ctx: EngineContext) -> None:
        self.config = config
        self.model_config = model
        # a context built by hand for one rank gets the size-1 group the contract promises
        ctx, own_group = with_process_group(ctx)
        # released by shutdown, or when the rollout is garbage-collected
        self._release_group = None
        if own_group is not None:
            self._release_group = weakref.finalize(self, release_single_rank_group, own_group)
        self.ctx = ctx
        self.pm = plugins.create_manager("rollout", config.backend, config.extensions)
        self.info = plugins.backend_info("rollout", config.backend)
        with backend_config_errors(section_path(ctx.role), config.backend):
            schema = self.pm.hook.config_schema()
            if schema is not None:
                config.options = options_of(config, schema)
            self.handle = self.pm.hook.build_rollout(config=config, model=model, ctx=ctx)
        if self.handle is None:
            raise GeartrainError(f"rollout '{config.backend}': build_rollout returned None")

    @property
    def name(self) -> str:
        return self.config.backend

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.config.dtype)

    @property
    def bucket_bytes(self) -> int:
        return self.config.weight_bucket_bytes

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, *, stream: bool = False) -> Batch:
        """The backend's samples. A backend that simulates generation time (the torch
        rollout's ``simulated_token_s``) gives each row the ``time.time()`` at which it
        finishes decoding in ``meta["ready_at"]`` instead of sleeping: by default this
        waits until the last row is ready and drops the key (the call lasts as long as
        its longest sample); ``stream=True`` returns at once with ``ready_at`` kept, for a
        caller that releases each group when it is ready (the separate rollout)."""
        batch = self.pm.hook.generate(rollout=self.handle, prompts=prompts, sampling=sampling)
        if not stream and READY_AT in batch.meta:
            wait_until(max(batch.meta.pop(READY_AT), default=0.0))
        return batch

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.pm.hook.update_weights(rollout=self.handle, named_tensors=named_tensors)

    @property
    def accepts_adapters(self) -> bool:
        """Whether the backend serves LoRA adapters (declares ``lora``)."""
        return "lora" in self.info.capabilities

    def update_adapter(self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        """Serve LoRA adapter ``name`` (the ``update_adapter`` hook; backends that declare ``lora``)."""
        if not self.pm.hook.update_adapter.get_hookimpls():
            raise GeartrainError(
                f"rollout '{self.name}' does not implement 'update_adapter' (no 'lora' capability); "
                "use actor.lora.sync = 'merged' with it"
            )
        self.pm.hook.update_adapter(rollout=self.handle, name=name, tensors=tensors, config=config)

    def release(self) -> MemoryStats:
        return self.pm.hook.release(rollout=self.handle)

    def resume(self) -> MemoryStats:
        return self.pm.hook.resume(rollout=self.handle)

    def shutdown(self) -> None:
        self.pm.hook.shutdown(rollout=self.handle)
        if self._release_group is not None:
            self._release_group()  # a finalizer runs once
