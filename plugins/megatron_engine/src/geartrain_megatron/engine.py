"""The engine's handle and ``shard``: parallel state, ``GPTModel`` chunks filled with the HF
weights, megatron's DDP wrapper (contiguous gradient buffers) and optimizer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from geartrain.config import EngineConfig
from geartrain.types import EngineContext
from torch import nn

from geartrain_megatron import modeling, parallel
from geartrain_megatron.compat import cpu_compat
from geartrain_megatron.compat import needed as on_cpu
from geartrain_megatron.convert import Dims
from geartrain_megatron.options import MegatronOptions
from geartrain_megatron.parallel import Layout


@dataclass(kw_only=True)
class MegatronModel:
    """The engine's handle (opaque to the core)."""

    chunks: list[nn.Module]
    """One module per virtual pipeline stage on this rank (megatron DDP-wrapped when the
    role trains)."""
    hf_config: Any
    """The transformers config the model was built from (for names and export)."""
    config: EngineConfig
    options: MegatronOptions
    ctx: EngineContext
    layout: Layout
    dims: Dims
    value_head: bool
    optimizer: Any = None
    steps: int = 0
    """Optimizer steps taken (the LR schedule's position)."""
    offloaded: frozenset[str] = field(default_factory=frozenset)
    parked: dict[str, list[Any]] = field(default_factory=dict)
    """What ``offload`` released, by kind (:class:`geartrain_megatron.offload.Parked`)."""

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if on_cpu() else torch.device("cuda", torch.cuda.current_device())

    @property
    def modules(self) -> list[nn.Module]:
        """The ``GPTModel`` chunks themselves (inside megatron's DDP wrapper if any)."""
        return [getattr(c, "module", c) for c in self.chunks]

    @property
    def tied(self) -> bool:
        return bool(getattr(self.hf_config, "tie_word_embeddings", False)) and not self.value_head


def _use_te(options: MegatronOptions) -> bool:
    if options.transformer_impl == "local":
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        if options.transformer_impl == "transformer_engine":
            raise ValueError(
                "options.transformer_impl = 'transformer_engine' but TransformerEngine is not installed"
            ) from None
        return False
    return not on_cpu()


def _hf_tensors(hf: nn.Module) -> Callable[[str], torch.Tensor]:
    state = hf.state_dict()

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise KeyError(f"the HF model has no tensor '{name}' (model type {hf.config.model_type})")
        return state[name]

    return get


def shard_model(
    hf: nn.Module, config: EngineConfig, options: MegatronOptions, ctx: EngineContext, *, value_head: bool
) -> MegatronModel:
    """Set up the parallel state, build this rank's chunks, load ``hf``'s weights into them,
    wrap them in megatron's DDP and create the optimizer (not when ``config.optim.lr == 0``)."""
    if config.param_dtype != "float32":
        raise ValueError(
            "param_dtype: the megatron engine computes in float32 only (bf16 mixed precision is not built yet)"
        )
    layout = parallel.setup(config.parallel, ctx, ep=options.expert_parallel)
    hf_config = hf.config
    if options.router_replay:
        if not modeling.num_experts(hf_config):
            raise ValueError(f"options.router_replay: model type '{hf_config.model_type}' has no MoE router to replay")

    with cpu_compat():
        chunks = modeling.build_chunks(
            hf_config,
            layout,
            value_head=value_head,
            recompute=config.gradient_checkpointing,
            use_te=_use_te(options),
            router_replay=options.router_replay,
        )
        modeling.load_hf_weights(chunks, _hf_tensors(hf), hf_config, layout, value_head=value_head)
        if not on_cpu():
            chunks = [c.cuda() for c in chunks]
        handle = MegatronModel(
            chunks=chunks,
            hf_config=hf_config,
            config=config,
            options=options,
            ctx=ctx,
            layout=layout,
            dims=modeling.dims_of(hf_config, layout.tp),
            value_head=value_head,
        )
        if config.optim.lr > 0:
            from geartrain_megatron.optim import build_optimizer, wrap_ddp

            handle.chunks = wrap_ddp(chunks, options)
            handle.optimizer = build_optimizer(handle.chunks, config.optim, options)
    return handle
