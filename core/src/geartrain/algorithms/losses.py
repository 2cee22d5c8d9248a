"""Ready-made :data:`geartrain.types.LossFn` for the actor and the critic, built from the
pure functions of this package (the policy losses of :mod:`geartrain.algorithms.policy_losses`;
the value loss and the entropy bonus, defined here).

They read these batch fields (all ``[B, T]``, aligned to ``input_ids``):

* always ``loss_mask`` (the tokens the engine counts in ``LossContext.global_tokens``);
* actor: ``old_log_probs``, ``advantages``; ``ref_log_probs`` when ``kl_loss_coef > 0``;
  ``rollout_log_probs`` when ``tis_cap`` is set; engine outputs ``log_probs`` and, when
  ``entropy_coef != 0``, ``entropy`` (set ``batch.info["need_entropy"] = True``);
* critic: ``old_values`` (values at rollout time), ``returns``; engine output ``values``.

Both return ``(loss share, metric shares)`` as the engine contract asks: summed over
micro-batches and data-parallel ranks, they give the loss and the metrics of the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from geartrain.algorithms.aggregation import AggMode, aggregate
from geartrain.algorithms.correction import masked_is_weights, truncated_is_weights
from geartrain.algorithms.kl import kl_estimate
from geartrain.algorithms.masked import finite_inputs, zero_outside
from geartrain.algorithms.policy_losses import PolicyLossConfig, get_policy_loss
from geartrain.batch import Batch
from geartrain.types import LossContext, LossFn


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_range: float | None = 0.5,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss per token: ``0.5 * max((V - R)^2, (clip(V, V_old ± c) - R)^2)``.

    ``clip_range=None`` gives plain ``0.5 (V - R)^2``. Returns ``(loss_mat [B, T],
    {"clipped": [B, T]})`` (``clipped``: the clipped term is strictly larger); zero
    outside ``mask``. Aggregate like the policy loss (verl: token-mean).
    """
    values, old_values, returns = finite_inputs(mask, values, old_values, returns)
    unclipped = (values - returns) ** 2
    if clip_range is None:
        loss, was_clipped = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        clipped_values = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
        clipped = (clipped_values - returns) ** 2
        loss, was_clipped = torch.maximum(unclipped, clipped), clipped > unclipped
    stats = {"clipped": zero_outside(was_clipped.to(values.dtype), mask).detach()}
    return zero_outside(0.5 * loss, mask), stats


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """Per-token loss term ``-coef * entropy`` (adding it to the loss rewards entropy);
    zero outside ``mask``."""
    return zero_outside(-coef * entropy, mask)


@dataclass(kw_only=True, slots=True)
class ActorLossConfig:
    policy_loss: str = "ppo"
    """A registered policy loss (``ppo``, ``gspo``, ``cispo``..., or yours)."""
    clip: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    loss_agg_mode: AggMode = "token-mean"
    """verl pairs GSPO with ``seq-mean-token-mean`` and Dr. GRPO with ``seq-mean-token-sum-norm``."""
    norm_length: int | None = None
    """``seq-mean-token-sum-norm``'s divisor (the max response length); default: the width."""
    entropy_coef: float = 0.0
    kl_loss_coef: float = 0.0
    """> 0 adds ``coef * KL(pi || pi_ref)`` to the loss (GRPO-style KL loss)."""
    kl_loss_kind: str = "k3"
    tis_cap: float | None = None
    """Truncated IS against the rollout's log-probs, weights capped here; ``None``: off."""
    is_correction: str = "truncate"
    """With ``tis_cap``: ``truncate`` caps each token's weight at ``tis_cap``; ``mask``
    (IcePop) drops the tokens whose weight lies outside ``[is_mask_low, tis_cap]``."""
    is_mask_low: float = 0.5


def make_actor_loss(config: ActorLossConfig | None = None) -> LossFn:
    """The actor's loss: policy loss (+ KL loss) (- entropy bonus), each aggregated with
    ``config.loss_agg_mode``. Metrics: ``actor/pg_loss``, ``actor/pg_clipfrac``,
    ``actor/pg_clipfrac_lower``, ``actor/ppo_kl``, ``actor/ratio_mean``, and
    ``actor/entropy`` / ``actor/kl_loss`` when enabled."""
    cfg = config or ActorLossConfig()
    policy_loss = get_policy_loss(cfg.policy_loss)

    def loss_fn(
        outputs: dict[str, torch.Tensor], batch: Batch, ctx: LossContext
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch["loss_mask"]
        log_probs = outputs["log_probs"]

        def agg(mat: torch.Tensor, mode: str | None = None) -> torch.Tensor:
            return aggregate(
                mat,
                mask,
                mode or cfg.loss_agg_mode,
                global_tokens=ctx.global_tokens,
                global_sequences=ctx.global_sequences,
                norm_length=cfg.norm_length,
            )

        weights = None
        if cfg.tis_cap is not None and cfg.is_correction == "mask":
            weights = masked_is_weights(
                batch["old_log_probs"], batch["rollout_log_probs"], mask, low=cfg.is_mask_low, high=cfg.tis_cap
            )
        elif cfg.tis_cap is not None:
            weights = truncated_is_weights(batch["old_log_probs"], batch["rollout_log_probs"], mask, cap=cfg.tis_cap)
        out = policy_loss(
            log_probs,
            batch["old_log_probs"].to(log_probs),
            batch["advantages"].to(log_probs),
            mask,
            config=cfg.clip,
            is_weights=weights,
        )
        pg_loss = agg(out.loss_mat, out.agg_mode)
        loss = pg_loss
        metrics = out.metrics(mask, global_tokens=ctx.global_tokens)
        metrics["actor/pg_loss"] = float(pg_loss.detach())
        if cfg.entropy_coef != 0.0:
            entropy = agg(outputs["entropy"])
            loss = loss - cfg.entropy_coef * entropy
            metrics["actor/entropy"] = float(entropy.detach())
        if cfg.kl_loss_coef > 0.0:
            kl = agg(kl_estimate(log_probs, batch["ref_log_probs"].to(log_probs), cfg.kl_loss_kind))
            loss = loss + cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = float(kl.detach())
        return loss, metrics

    return loss_fn


@dataclass(kw_only=True, slots=True)
class CriticLossConfig:
    clip_range: float | None = 0.5
    loss_agg_mode: AggMode = "token-mean"
    norm_length: int | None = None


def make_critic_loss(config: CriticLossConfig | None = None) -> LossFn:
    """The critic's clipped value loss. Metrics: ``critic/vf_loss``, ``critic/vf_clipfrac``."""
    cfg = config or CriticLossConfig()

    def loss_fn(
        outputs: dict[str, torch.Tensor], batch: Batch, ctx: LossContext
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch["loss_mask"]
        values = outputs["values"]
        loss_mat, stats = value_loss(
            values, batch["old_values"].to(values), batch["returns"].to(values), mask, clip_range=cfg.clip_range
        )
        loss = aggregate(
            loss_mat,
            mask,
            cfg.loss_agg_mode,
            global_tokens=ctx.global_tokens,
            global_sequences=ctx.global_sequences,
            norm_length=cfg.norm_length,
        )
        clipfrac = aggregate(stats["clipped"], mask, "token-mean", global_tokens=ctx.global_tokens)
        return loss, {"critic/vf_loss": float(loss.detach()), "critic/vf_clipfrac": float(clipfrac)}

    return loss_fn
