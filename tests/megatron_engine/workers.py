"""Functions run inside spawned gloo ranks (module level so that spawn can import them).
Each returns plain CPU tensors / floats for the test process to compare."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from geartrain.checkpoint import CheckpointManager

from .common import STEPS, Receiver, make_batch, make_engine, token_mean_loss


def train_and_sync(
    rank: int, world: int, family: str, parallel: dict, budget: int, save_to: str | None, load_from: str | None
) -> dict[str, Any]:
    """Forward (log-probs, entropy) on ``make_batch(0)``, ``STEPS`` training steps, the
    full weights through ``reshard_for_rollout``; optionally save a checkpoint and, from
    a checkpoint saved in another layout, load it and report its log-probs and weights."""
    sizes = {k: v for k, v in parallel.items() if k != "options"}
    engine = make_engine(family, rank, world, budget=budget, options=parallel.get("options"), **sizes)
    dp = engine.dp
    out: dict[str, Any] = {"dp": (dp.rank, dp.size), "loss": [], "grad_norm": [], "micro_batches": []}
    out["forward"] = engine.compute_log_probs(make_batch(0).split(dp.size)[dp.rank], entropy=True).outputs
    for step in range(STEPS):
        res = engine.forward_backward(make_batch(10 + step).split(dp.size)[dp.rank], token_mean_loss)
        out["loss"].append(res.metrics["loss"])
        out["micro_batches"].append(res.metrics["micro_batches"])
        out["grad_norm"].append(engine.optimizer_step()["grad_norm"])
    receiver = Receiver()
    engine.sync_weights(receiver)
    out["weights"] = receiver.tensors
    if save_to:
        engine.save_checkpoint(CheckpointManager(Path(save_to)), STEPS, {"saved": parallel})
        out["probe"] = engine.compute_log_probs(make_batch(7).split(dp.size)[dp.rank]).outputs["log_probs"]
    if load_from:
        # a fresh engine (initial weights, no optimizer state) restores the other layout's one
        engine = make_engine(family, rank, world, budget=budget, options=parallel.get("options"), **sizes)
        latest = CheckpointManager(Path(load_from)).latest()
        assert latest is not None
        out["loaded_extra"] = engine.load_checkpoint(latest)
        out["probe"] = engine.compute_log_probs(make_batch(7).split(dp.size)[dp.rank]).outputs["log_probs"]
        receiver = Receiver()
        engine.sync_weights(receiver)
        out["loaded_weights"] = receiver.tensors
    return out


def sum_pi_squared_outputs(rank: int, world: int, family: str, parallel: dict, budget: int) -> dict[str, Any]:
    """Σπ² of ``make_batch(0)`` from a forward and from a training step's micro-batches
    (the loss reports the sum it was given over the loss tokens)."""
    from geartrain.testing.reference import token_mean_nll_loss

    engine = make_engine(family, rank, world, budget=budget, **parallel)
    forward = engine.compute_log_probs(make_batch(0), sum_pi_squared=True).outputs

    def loss(outputs, micro_batch, ctx):  # noqa: ANN001, ANN202
        share, metrics = token_mean_nll_loss(outputs, micro_batch, ctx)
        mask = micro_batch["loss_mask"].bool()
        return share, {**metrics, "spp": float(outputs["sum_pi_squared"].detach()[mask].sum())}

    batch = make_batch(0)
    batch.info["need_sum_pi_squared"] = True
    step = engine.forward_backward(batch, loss)
    return {"forward": forward["sum_pi_squared"], "step": step.outputs["sum_pi_squared"], "metrics": step.metrics}
