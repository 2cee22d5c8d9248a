"""The forwards between an RL step's rewards and its advantages, and the reuse path.

Before the advantages a step needs the old policy's log-probs (the PPO ratio's
denominator), the reference's (KL) and the critic's values (GAE). The old log-probs come
from a separate actor forward, or, when the batch gets exactly one optimizer step, from the
update's own forward (:func:`reuses_update_log_probs`, :func:`update_reusing`): the same
weights on the same micro-batches give the same numbers, one forward fewer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from geartrain.algorithms import get_advantage
from geartrain.batch import Batch
from geartrain.cluster import Dispatch, WorkerGroup
from geartrain.trainer.config import TrainConfig
from geartrain.trainer.step_metrics import policy_metrics


def reuses_update_log_probs(config: TrainConfig) -> bool:
    """Whether a step skips the separate old-log-prob forward: the batch gets exactly one
    optimizer step (one epoch, one mini-batch), so the old log-probs are the detached
    log-probs of the update's own forward; nothing before the update needs them (no KL
    penalty in the reward, no ``Σπ²`` for the advantages); ``trainer.reuse_update_log_probs``
    is on."""
    algo = config.algorithm
    return (
        config.trainer.reuse_update_log_probs
        and algo.ppo_epochs == 1
        and algo.mini_batches == 1
        and not algo.use_kl_in_reward
        and not needs_sum_pi_squared(config)
    )


def needs_sum_pi_squared(config: TrainConfig) -> bool:
    """Whether the job's advantage estimator reads the old policy's ``Σ_v π(v)²`` per token
    (the optimal token baseline): the old log-prob forward then returns it too, and it
    runs before the advantages (never reused from the update)."""
    return bool(getattr(get_advantage(config.algorithm.estimator), "needs_sum_pi_squared", False))


def forward(
    batch: Batch,
    *,
    actor: WorkerGroup | None,
    reference: WorkerGroup | None,
    critic: WorkerGroup | None,
    reference_call: str = "compute_log_probs",
    sum_pi_squared: bool = False,
) -> dict[str, Any]:
    """Add ``old_log_probs`` (from ``actor``; ``None``: the update gives them),
    ``ref_log_probs`` (``reference``'s ``reference_call`` method: ``compute_ref_log_probs``
    when the reference is the LoRA actor's base) and ``old_values`` to ``batch``, for the
    roles given; with ``sum_pi_squared``, also the old policy's ``sum_pi_squared``. Returns
    the metrics of the old log-probs (:func:`~geartrain.trainer.step_metrics.policy_metrics`)."""
    entropy = None
    if actor is not None:
        extra = {"sum_pi_squared": True} if sum_pi_squared else {}
        old = actor.call("compute_log_probs", batch, dispatch=Dispatch.DP, **extra)
        batch["old_log_probs"] = old.outputs["log_probs"]
        if sum_pi_squared:
            batch["sum_pi_squared"] = old.outputs["sum_pi_squared"]
        if "routed_experts" in old.outputs:  # MoE router replay: the update routes as this forward did
            batch["routed_experts"] = old.outputs["routed_experts"]
        entropy = old.outputs.get("entropy")
    if reference is not None:
        batch["ref_log_probs"] = reference.call(reference_call, batch, dispatch=Dispatch.DP).outputs["log_probs"]
    if critic is not None:
        batch["old_values"] = critic.call("compute_values", batch, dispatch=Dispatch.DP).outputs["values"]
    return policy_metrics(batch, entropy) if actor is not None else {}


def update_reusing(actor: WorkerGroup, batch: Batch, then: Callable[[], None] | None = None) -> dict[str, Any]:
    """The actor's one optimizer step on ``batch`` whose own forward gives the old
    log-probs (set on ``batch``); returns the update's metrics and those the separate
    forward would have given. ``then`` runs once the update is sent, before its result
    is awaited (it may send the actor group more calls, which run after the update)."""
    if then is None:
        out = actor.call("update_once", batch, dispatch=Dispatch.DP)
    else:
        pending = actor.submit("update_once", batch, dispatch=Dispatch.DP)
        then()
        out = pending.result()
    batch["old_log_probs"] = out.outputs["log_probs"]
    return {**out.metrics, **policy_metrics(batch, out.outputs["entropy"])}
