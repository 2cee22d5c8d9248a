"""MoE functions run inside spawned gloo ranks (module level so that spawn can import them)."""

from __future__ import annotations

from typing import Any

from geartrain.config import EngineConfig, ModelConfig, OptimConfig, ParallelConfig
from geartrain.engine import Engine

from .common import make_batch, rank_context, token_mean_loss


def expert_parallel_step(rank: int, world: int, path: str) -> dict[str, Any]:
    """Log-probs, one training step and log-probs again, at dp=world, expert_parallel=world."""
    config = EngineConfig(
        backend="megatron",
        parallel=ParallelConfig(dp=world),
        optim=OptimConfig(lr=1e-3, weight_decay=0.01, clip_grad=1.0),
        options={"expert_parallel": world},
    )
    engine = Engine(config, ModelConfig(path=path, tokenizer=None), rank_context(rank, world))
    dp = engine.dp
    experts = [int(i) for i in engine.handle.modules[0].decoder.layers[0].mlp.local_expert_indices]
    out: dict[str, Any] = {"dp": dp.rank, "experts": experts}
    out["before"] = engine.compute_log_probs(make_batch(0).split(dp.size)[dp.rank]).outputs["log_probs"]
    res = engine.forward_backward(make_batch(10).split(dp.size)[dp.rank], token_mean_loss)
    out["loss"] = res.metrics["loss"]
    out["grad_norm"] = engine.optimizer_step()["grad_norm"]
    out["after"] = engine.compute_log_probs(make_batch(0).split(dp.size)[dp.rank]).outputs["log_probs"]
    return out
