"""Policy losses (PPO clip with clip-higher and dual-clip, GSPO), the value loss and the
entropy bonus, as per-token loss matrices.

A policy loss is called as::

    out = policy_loss(log_probs, old_log_probs, advantages, mask, config=PolicyLossConfig(...),
                      is_weights=None)

with ``[B, T]`` tensors aligned alike (see :mod:`geartrain.types`). ``out.loss_mat [B, T]``
is the per-token loss (differentiable in ``log_probs``; reduce it with
:func:`geartrain.algorithms.aggregate`); ``out.token_stats`` holds detached per-token
quantities (``clipped``, ``clipped_lower``, ``approx_kl``, ``ratio``) whose token-mean
is a metric; :meth:`PolicyLossOutput.metrics` averages them (as global shares when given
``global_tokens``, so they sum over micro-batches and ranks like the loss).

``is_weights`` (``[B, T]``, detached; see :mod:`geartrain.algorithms.correction`)
multiply the per-token loss to correct a rollout-vs-trainer mismatch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from geartrain.algorithms.aggregation import aggregate
from geartrain.algorithms.registry import Registry


@dataclass(kw_only=True, slots=True)
class PolicyLossConfig:
    """Clip settings. ``clip_ratio_low``/``clip_ratio_high`` default to ``clip_ratio``."""

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    """Clip-higher (DAPO) uses e.g. ``low=0.2, high=0.28``."""
    clip_ratio_c: float | None = 3.0
    """Dual-clip bound for negative advantages (must be > 1); ``None`` turns dual-clip off."""
    log_ratio_clamp: float = 20.0
    """PPO: ``log_probs - old_log_probs`` is clamped to ``±log_ratio_clamp`` before ``exp``."""
    gspo_log_ratio_clamp: float = 10.0
    """GSPO: upper clamp of the token's log sequence-ratio before ``exp``."""
    tau_pos: float = 1.0
    """SAPO: gate temperature for tokens with a positive advantage (verl: 1.0)."""
    tau_neg: float = 1.05
    """SAPO: gate temperature for the others (verl: 1.05)."""
    clip_cov_ratio: float = 0.0002
    """Clip-Cov: share of the masked tokens whose gradient is cut (at least one)."""
    clip_cov_lb: float = 1.0
    """Clip-Cov: lower covariance bound of the candidates."""
    clip_cov_ub: float = 5.0
    """Clip-Cov: upper covariance bound of the candidates."""
    kl_cov_ratio: float = 0.0002
    """KL-Cov: share of the masked tokens (largest covariance) given the KL penalty."""
    kl_cov_coef: float = 0.1
    """KL-Cov: coefficient of ``|logp - old_logp|`` on those tokens (verl's ppo_kl_coef)."""

    @property
    def low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


@dataclass(kw_only=True, slots=True)
class PolicyLossOutput:
    """Per-token loss ``[B, T]`` and detached per-token statistics ``[B, T]``."""

    loss_mat: torch.Tensor
    token_stats: dict[str, torch.Tensor] = field(default_factory=dict)
    agg_mode: str | None = None
    """The aggregation this loss is defined with, overriding ``loss_agg_mode`` (verl fixes
    it for SAPO and GMPO); ``None``: the configured mode."""

    def metrics(
        self, mask: torch.Tensor, *, global_tokens: int | float | None = None, prefix: str = "actor/"
    ) -> dict[str, float]:
        """Token-mean of every statistic under ``mask`` (``pg_clipfrac``,
        ``pg_clipfrac_lower``, ``ppo_kl``, ``ratio_mean``), as a share when
        ``global_tokens`` is given."""
        names = {
            "clipped": "pg_clipfrac",
            "clipped_lower": "pg_clipfrac_lower",
            "approx_kl": "ppo_kl",
            "ratio": "ratio_mean",
        }
        return {
            prefix + names.get(key, key): float(
                aggregate(value.detach(), mask, "token-mean", global_tokens=global_tokens)
            )
            for key, value in self.token_stats.items()
        }


class PolicyLoss(Protocol):
    """The call signature of every registered policy loss (see the module docstring)."""

    def __call__(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        *,
        config: PolicyLossConfig,
        is_weights: torch.Tensor | None = None,
    ) -> PolicyLossOutput: ...


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def register_policy_loss(name: str, *, override: bool = False) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator registering a policy loss under ``name``."""
    return POLICY_LOSSES.register(name, override=override)


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as ``name`` (``ppo``, ``gspo``, or one of yours)."""
    return POLICY_LOSSES.get(name)


def _zero_outside(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _finite_inputs(mask: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Inputs with masked-out positions set to 0, so junk there (``-inf`` log-probs of
    padding) gives neither a nan loss nor a nan gradient."""
    return tuple(_zero_outside(t, mask) for t in tensors)


@register_policy_loss("ppo")
def ppo_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig,
    is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """PPO's clipped surrogate with asymmetric clipping and dual-clip.

    ``r = exp(clamp(logp - old_logp, ±log_ratio_clamp))``;
    ``L = max(-A r, -A clip(r, 1 - low, 1 + high))``; for ``A < 0`` (dual-clip)
    ``L = min(L, -A c)`` with ``c = clip_ratio_c``. ``clipped`` marks tokens where the clipped
    term is the larger (strictly), ``clipped_lower`` negative-advantage tokens where the
    dual-clip bound wins (strictly). Loss and stats are 0 outside ``mask``.
    """
    if config.clip_ratio_c is not None and config.clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {config.clip_ratio_c}")
    log_probs, old_log_probs, advantages = _finite_inputs(mask, log_probs, old_log_probs, advantages)
    log_ratio = torch.clamp(log_probs - old_log_probs, -config.log_ratio_clamp, config.log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - config.low, 1 + config.high)
    loss = torch.maximum(unclipped, clipped)
    clipped_lower = torch.zeros_like(loss, dtype=torch.bool)
    if config.clip_ratio_c is not None:
        bound = -advantages * config.clip_ratio_c
        negative = advantages < 0
        clipped_lower = negative & (loss > bound)
        loss = torch.where(negative, torch.minimum(loss, bound), loss)
    if is_weights is not None:
        loss = loss * is_weights.detach()
    stats = {
        "clipped": _zero_outside((clipped > unclipped).to(loss.dtype), mask).detach(),
        "clipped_lower": _zero_outside(clipped_lower.to(loss.dtype), mask).detach(),
        "approx_kl": _zero_outside(-log_ratio, mask).detach(),
        "ratio": _zero_outside(ratio, mask).detach(),
    }
    return PolicyLossOutput(loss_mat=_zero_outside(loss, mask), token_stats=stats)


@register_policy_loss("gspo")
def gspo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig,
    is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """GSPO: a sequence-level ratio with a per-token gradient.

    ``s_i = exp(masked mean_t (logp - old_logp))``; each token uses
    ``s_it = exp(min(sg[log s_i] + logp_t - sg[logp_t], gspo_log_ratio_clamp))`` (value
    ``s_i``, gradient of ``s_i * logp_t``) in ``max(-A s_it, -A clip(s_it, 1 - low, 1 + high))``.
    No dual-clip. verl aggregates GSPO with ``seq-mean-token-mean``.
    """
    log_probs, old_log_probs, advantages = _finite_inputs(mask, log_probs, old_log_probs, advantages)
    m = mask.to(log_probs.dtype)
    token_log_ratio = log_probs - old_log_probs
    seq_log_ratio = (_zero_outside(token_log_ratio, mask).sum(-1) / m.sum(-1).clamp(min=1)).detach()
    log_ratio = log_probs - log_probs.detach() + seq_log_ratio.unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_ratio, max=config.gspo_log_ratio_clamp))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - config.low, 1 + config.high)
    loss = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        loss = loss * is_weights.detach()
    stats = {
        "clipped": _zero_outside((clipped > unclipped).to(loss.dtype), mask).detach(),
        "clipped_lower": torch.zeros_like(loss).detach(),
        "approx_kl": _zero_outside(-token_log_ratio, mask).detach(),
        "ratio": _zero_outside(ratio, mask).detach(),
    }
    return PolicyLossOutput(loss_mat=_zero_outside(loss, mask), token_stats=stats)


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
    values, old_values, returns = _finite_inputs(mask, values, old_values, returns)
    unclipped = (values - returns) ** 2
    if clip_range is None:
        loss, was_clipped = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        clipped_values = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
        clipped = (clipped_values - returns) ** 2
        loss, was_clipped = torch.maximum(unclipped, clipped), clipped > unclipped
    stats = {"clipped": _zero_outside(was_clipped.to(values.dtype), mask).detach()}
    return _zero_outside(0.5 * loss, mask), stats


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """Per-token loss term ``-coef * entropy`` (adding it to the loss rewards entropy);
    zero outside ``mask``."""
    return _zero_outside(-coef * entropy, mask)
