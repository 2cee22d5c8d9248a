"""The megatron engine's own options section (``[actor.engine.options]``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class MegatronOptions(BaseModel):
    """Options of the ``megatron`` engine backend; validated by the core via ``config_schema``."""

    model_config = ConfigDict(extra="forbid")

    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """Layer implementation: megatron's own modules (``local``, works everywhere) or
    TransformerEngine's (``transformer_engine``, GPU). ``auto``: TransformerEngine when it
    is importable and a GPU is present, else local."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state (and the fp32 main weights) over data-parallel ranks
    (megatron's distributed optimizer)."""
    expert_parallel: int = Field(1, ge=1)
    """MoE models: split the experts of each layer over this many data-parallel ranks
    (megatron's expert parallelism; must divide ``parallel.dp`` and the number of experts)."""
    router_replay: bool = False
    """MoE models: record the experts each token is routed to and replay them. A forward of
    a batch without a ``routed_experts`` field records the routing and returns it as
    ``outputs["routed_experts"]`` (``[B, T, MoE layers, top-k]`` expert ids, per input token);
    a forward/backward of a batch that carries ``routed_experts`` routes every token to
    exactly those experts (the router's probabilities are still computed from the current
    weights, so it trains), so log-probs recomputed later (after a weight update, at another
    micro-batching, in the activation recompute of ``gradient_checkpointing``) use the same
    experts as the first forward. The trainer copies the old-log-prob forward's routing into
    the batch, so the update replays it (a reference engine with this option on would replay
    the actor's routing too). Refused for dense models."""
