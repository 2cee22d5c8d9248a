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


def replay_run(rank: int, world: int, path: str, pp: int, checkpointing: bool) -> dict[str, Any]:
    """Router replay at pipeline size ``pp``: record the routing of ``make_batch(3)``, take
    one step, then train on the batch again replaying the recorded routing (several
    micro-batches: the 1F1B schedule and the recompute queue are exercised)."""
    config = EngineConfig(
        backend="megatron",
        parallel=ParallelConfig(pp=pp),
        optim=OptimConfig(lr=2e-2, weight_decay=0.01, clip_grad=1.0),
        max_tokens_per_micro_batch=40,
        gradient_checkpointing=checkpointing,
        options={"router_replay": True},
    )
    engine = Engine(config, ModelConfig(path=path, tokenizer=None), rank_context(rank, world))
    batch = make_batch(3, rows=8)
    first = engine.compute_log_probs(batch).outputs
    engine.forward_backward(make_batch(4, rows=8), token_mean_loss)
    engine.optimizer_step()
    free = engine.compute_log_probs(batch).outputs["routed_experts"]
    replayed = batch.clone()
    replayed["routed_experts"] = first["routed_experts"]
    out = engine.forward_backward(replayed, token_mean_loss)
    stats = engine.optimizer_step()
    return {
        "routed": first["routed_experts"],
        "free": free,
        "log_probs": out.outputs["log_probs"],
        "loss": out.metrics["loss"],
        "micro_batches": out.metrics["micro_batches"],
        "grad_norm": stats["grad_norm"],
    }
