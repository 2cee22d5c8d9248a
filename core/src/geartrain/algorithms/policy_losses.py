"""Every built-in policy loss, and what a policy loss is (config, output, registry).

PPO clip (with clip-higher and dual-clip), GSPO, plain REINFORCE, GPG, CISPO, SAPO, GMPO,
Clip-Cov, KL-Cov, DPPO (Binary-TV / Binary-KL) and DRO, registered under verl 0.9's names.
A policy loss is called as::

    out = policy_loss(log_probs, old_log_probs, advantages, mask, config=PolicyLossConfig(...),
                      is_weights=None)

with ``[B, T]`` tensors aligned alike (see :mod:`geartrain.types`). ``out.loss_mat [B, T]``
is the per-token loss (differentiable in ``log_probs``; reduce it with
:func:`geartrain.algorithms.aggregate`); ``out.token_stats`` holds detached per-token
quantities (``clipped``, ``clipped_lower``, ``approx_kl``, ``ratio``) whose token-mean
is a metric; :meth:`PolicyLossOutput.metrics` averages them (as global shares when given
``global_tokens``, so they sum over micro-batches and ranks like the loss). Each loss's
knobs live in :class:`PolicyLossConfig`.

Where verl fixes the aggregation of a loss (SAPO and GMPO average per sequence whatever
``loss_agg_mode`` says), the output's ``agg_mode`` carries it and the actor loss obeys it.

``is_weights`` (``[B, T]``, detached; see :mod:`geartrain.algorithms.correction`)
multiply the per-token loss to correct a rollout-vs-trainer mismatch.

The value loss and the entropy bonus are in :mod:`geartrain.algorithms.losses`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from geartrain.algorithms.aggregation import aggregate
from geartrain.algorithms.masked import finite_inputs, masked_mean, zero_outside
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
    dro_beta: float | None = None
    """DRO: weight of the quadratic log-ratio penalty (verl's ``policy_loss.dro_beta``); the
    ``dro`` loss needs it set, > 0."""

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


def _log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, config: PolicyLossConfig) -> torch.Tensor:
    """``logp - old_logp`` clamped to ``±log_ratio_clamp`` (verl's clamp before ``exp``: 20)."""
    return torch.clamp(log_probs - old_log_probs, -config.log_ratio_clamp, config.log_ratio_clamp)


def _stats(
    mask: torch.Tensor, log_ratio: torch.Tensor, ratio: torch.Tensor, **flags: torch.Tensor
) -> dict[str, torch.Tensor]:
    stats = {name: zero_outside(flag.to(ratio.dtype), mask).detach() for name, flag in flags.items()}
    stats["approx_kl"] = zero_outside(-log_ratio, mask).detach()
    stats["ratio"] = zero_outside(ratio, mask).detach()
    return stats


def _weighted(loss: torch.Tensor, is_weights: torch.Tensor | None) -> torch.Tensor:
    return loss if is_weights is None else loss * is_weights.detach()


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
    log_probs, old_log_probs, advantages = finite_inputs(mask, log_probs, old_log_probs, advantages)
    log_ratio = _log_ratio(log_probs, old_log_probs, config)
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
        "clipped": zero_outside((clipped > unclipped).to(loss.dtype), mask).detach(),
        "clipped_lower": zero_outside(clipped_lower.to(loss.dtype), mask).detach(),
        "approx_kl": zero_outside(-log_ratio, mask).detach(),
        "ratio": zero_outside(ratio, mask).detach(),
    }
    return PolicyLossOutput(loss_mat=zero_outside(loss, mask), token_stats=stats)


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
    log_probs, old_log_probs, advantages = finite_inputs(mask, log_probs, old_log_probs, advantages)
    m = mask.to(log_probs.dtype)
    token_log_ratio = log_probs - old_log_probs
    seq_log_ratio = (zero_outside(token_log_ratio, mask).sum(-1) / m.sum(-1).clamp(min=1)).detach()
    log_ratio = log_probs - log_probs.detach() + seq_log_ratio.unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_ratio, max=config.gspo_log_ratio_clamp))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - config.low, 1 + config.high)
    loss = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        loss = loss * is_weights.detach()
    stats = {
        "clipped": zero_outside((clipped > unclipped).to(loss.dtype), mask).detach(),
        "clipped_lower": torch.zeros_like(loss).detach(),
        "approx_kl": zero_outside(-token_log_ratio, mask).detach(),
        "ratio": zero_outside(ratio, mask).detach(),
    }
    return PolicyLossOutput(loss_mat=zero_outside(loss, mask), token_stats=stats)


@register_policy_loss("reinforce")
def reinforce_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig,
    is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """Plain REINFORCE (Williams, 1992): ``L_t = -A_t * log pi(y_t)``, no ratio, no clip
    (verl's ``compute_policy_loss_reinforce``; with ``is_weights`` the truncated-IS form
    ``-w_t A_t log pi``). On-policy only: with several PPO epochs / mini-batches the later
    updates are not corrected for the policy having moved."""
    log_probs, old_log_probs, advantages = finite_inputs(mask, log_probs, old_log_probs, advantages)
    log_ratio = _log_ratio(log_probs, old_log_probs, config).detach()
    loss = _weighted(-advantages * log_probs, is_weights)
    return PolicyLossOutput(
        loss_mat=zero_outside(loss, mask), token_stats=_stats(mask, log_ratio, torch.exp(log_ratio))
    )


@register_policy_loss("gpg")
def gpg_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig,
    is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """GPG, Group Policy Gradient (Chu et al., 2025, arXiv:2504.02546): the policy-gradient
    loss ``L_t = -A_t * log pi(y_t)`` without a surrogate ratio or clipping (verl's
    ``gpg`` loss; the same formula as ``reinforce``). Pair it with the ``gpg`` estimator."""
    return reinforce_loss(log_probs, old_log_probs, advantages, mask, config=config, is_weights=is_weights)


@register_policy_loss("cispo")
def cispo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig,
    is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, arXiv:2506.13585): clip the importance weight, not the update.

    ``r = exp(clamp(logp - old, ±log_ratio_clamp))``, ``L_t = -sg(clip(r, 1 - low, 1 + high)) * A_t *
    log pi(y_t)``: every token keeps a gradient, scaled by its clipped, detached ratio
    (verl's ``cispo``). ``clipped`` marks tokens whose ratio was clipped."""
    log_probs, old_log_probs, advantages = finite_inputs(mask, log_probs, old_log_probs, advantages)
    log_ratio = _log_ratio(log_probs, old_log_probs, config)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - config.low, 1 + config.high)
    loss = _weighted(-clipped_ratio.detach() * advantages * log_probs, is_weights)
    stats = _stats(mask, log_ratio, ratio, clipped=clipped_ratio != ratio)
    return PolicyLossOutput(loss_mat=zero_outside(loss, mask), token_stats=stats)


@register_policy_loss("sapo")
def sapo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig,
    is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """SAPO, soft adaptive policy optimisation (arXiv:2511.20347): a smooth gate instead of
    a hard clip. ``f(r) = (4 / tau) * sigmoid(tau (r - 1))`` with ``tau = tau_pos`` where
    ``A > 0`` and ``tau_neg`` otherwise; ``L_t = -f(r_t) A_t`` (``df/dr = 1`` at ``r = 1``,
    so on-policy it is the plain policy gradient). As in verl, SAPO aggregates with
    ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says."""
    log_probs, old_log_probs, advantages = finite_inputs(mask, log_probs, old_log_probs, advantages)
    log_ratio = _log_ratio(log_probs, old_log_probs, config)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, config.tau_pos, config.tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = _weighted(-gate * advantages, is_weights)
    return PolicyLossOutput(
        loss_mat=zero_outside(loss, mask), token_stats=_stats(mask, log_ratio, ratio), agg_mode="seq-mean-token-mean"
    )


@register_policy_loss("gmpo")
def gmpo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig,
    is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """GMPO, geometric-mean policy optimisation (arXiv:2507.20673; verl's ``geo_mean``).

    Per token ``d_t = logp - old_logp`` is clipped *in log space* in the direction that
    matters: ``d'_t = sgn(A) * min(sgn(A) d_t, sgn(A) clamp(d_t, -low, high))``. The
    sequence ratio is the geometric mean ``R_i = exp(sum_t d'_t / (n_i + 1e-8))`` and the
    sequence advantage ``A_i = sum_t A_t / (n_i + 1e-8)``; ``L_i = -A_i R_i``. The loss is a
    per-sequence value, so ``loss_mat`` holds ``L_i`` on every token of row ``i`` and the
    aggregation is ``seq-mean-token-mean`` (= the mean over sequences, verl's choice).
    Note ``low``/``high`` are log-ratio bounds here (GMPO uses e.g. 0.4), not ratio bounds.
    ``is_weights`` enter as their per-sequence geometric mean (verl).
    """
    log_probs, old_log_probs, advantages = finite_inputs(mask, log_probs, old_log_probs, advantages)
    m = mask.to(log_probs.dtype)
    log_ratio = log_probs - old_log_probs
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -config.low, config.high)
    kept = sign * torch.minimum(sign * log_ratio, sign * clamped)
    count = m.sum(-1) + 1e-8
    seq_ratio = torch.exp((kept * m).sum(-1) / count)
    seq_adv = (advantages * m).sum(-1) / count
    seq_loss = -seq_adv * seq_ratio
    if is_weights is not None:
        seq_w = torch.exp((torch.log(is_weights.detach() + 1e-10) * m).sum(-1) / count)
        seq_loss = seq_loss * seq_w
    loss = seq_loss.unsqueeze(-1).expand_as(log_probs)
    was_clipped = log_ratio != clamped
    stats = _stats(
        mask,
        log_ratio.detach(),
        torch.exp(log_ratio.detach()),
        clipped=was_clipped & (advantages > 0),
        clipped_lower=was_clipped & (advantages < 0),
    )
    return PolicyLossOutput(loss_mat=zero_outside(loss, mask), token_stats=stats, agg_mode="seq-mean-token-mean")


def _ppo_terms(
    ratio: torch.Tensor, advantages: torch.Tensor, config: PolicyLossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    return -advantages * ratio, -advantages * torch.clamp(ratio, 1 - config.low, 1 + config.high)


@register_policy_loss("clip_cov")
def clip_cov_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig,
    is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """Clip-Cov (Cui et al., "The Entropy Mechanism of RL for Reasoning LMs",
    arXiv:2505.22617; verl's ``clip_cov``).

    PPO's clipped surrogate ``max(-A r, -A clip(r, 1 - low, 1 + high))`` (no dual-clip),
    and in addition the gradient of a few high-covariance tokens is cut: with
    ``cov_t = (A_t - mean A) (logp_t - mean logp)`` (means over the masked tokens of this
    micro-batch), the candidates are unclipped masked tokens with
    ``clip_cov_lb < cov_t < clip_cov_ub``; ``max(int(clip_cov_ratio * n_tokens), 1)`` of
    them, drawn uniformly at random (torch's generator, as verl), get loss 0.
    ``clipped`` marks those tokens.
    """
    log_probs, old_log_probs, advantages = finite_inputs(mask, log_probs, old_log_probs, advantages)
    valid = mask.bool()
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    unclipped, clipped = _ppo_terms(ratio, advantages, config)
    by_ratio = (clipped > unclipped) & valid
    with torch.no_grad():
        cov = (advantages - masked_mean(advantages, mask)) * (log_probs - masked_mean(log_probs, mask))
        candidates = valid & ~by_ratio & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)
        index = torch.nonzero(candidates)
        n_cut = max(int(config.clip_cov_ratio * int(valid.sum())), 1)
        if len(index) > n_cut:
            index = index[torch.randperm(len(index))[:n_cut]]
        keep = torch.ones_like(log_probs)
        keep[index[:, 0], index[:, 1]] = 0.0
    loss = _weighted(torch.maximum(unclipped, clipped) * keep, is_weights)
    stats = _stats(mask, log_ratio.detach(), ratio.detach(), clipped=keep == 0)
    return PolicyLossOutput(loss_mat=zero_outside(loss, mask), token_stats=stats)


@register_policy_loss("kl_cov")
def kl_cov_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig,
    is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """KL-Cov (Cui et al., arXiv:2505.22617; verl's ``kl_cov``).

    The unclipped surrogate ``-A r``, plus ``kl_cov_coef * |logp - old_logp|`` on the
    ``max(1, int(kl_cov_ratio * n_tokens))`` masked tokens with the largest covariance
    ``(A_t - mean A)(logp_t - mean logp)`` (means over this micro-batch's masked tokens;
    ties: the lowest flat index first). ``clipped`` marks the penalised tokens. As in verl,
    ``approx_kl`` (logged as ``actor/ppo_kl``) is ``|logp - old_logp|`` here, not its
    negative.
    """
    log_probs, old_log_probs, advantages = finite_inputs(mask, log_probs, old_log_probs, advantages)
    valid = mask.bool()
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    loss = -advantages * ratio
    penalised = torch.zeros_like(valid)
    with torch.no_grad():
        flat_valid = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
        if len(flat_valid):
            adv = advantages.reshape(-1)[flat_valid]
            logp = log_probs.detach().reshape(-1)[flat_valid]
            cov = (adv - adv.mean()) * (logp - logp.mean())
            k = max(1, int(len(cov) * config.kl_cov_ratio))
            top = flat_valid[torch.topk(cov, k, largest=True, sorted=True).indices]
            penalised.view(-1)[top] = True
    loss = torch.where(penalised, loss + config.kl_cov_coef * log_ratio.abs(), loss)
    stats = _stats(mask, log_ratio.detach(), ratio.detach(), clipped=penalised)
    stats["approx_kl"] = zero_outside(log_ratio.detach().abs(), mask)  # verl logs KL-Cov's ppo_kl as mean |Δlogp|
    return PolicyLossOutput(loss_mat=zero_outside(_weighted(loss, is_weights), mask), token_stats=stats)


def _dppo(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig,
    is_weights: torch.Tensor | None,
    divergence: str,
) -> PolicyLossOutput:
    log_probs, old_log_probs, advantages = finite_inputs(mask, log_probs, old_log_probs, advantages)
    log_ratio = _log_ratio(log_probs, old_log_probs, config)
    ratio = torch.exp(log_ratio)
    cap = config.clip_ratio_c if config.clip_ratio_c is not None else float("inf")
    truncated = torch.clamp(ratio, max=cap).detach()
    with torch.no_grad():
        p, q = torch.exp(log_probs), torch.exp(old_log_probs)
        if divergence == "tv":
            ok_pos, ok_neg = (p - q) <= config.high, (p - q) >= -config.low
        else:
            kl = q * (old_log_probs - log_probs) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
            ok_pos, ok_neg = (kl <= config.high) | (p <= q), (kl <= config.low) | (p >= q)
        inside = torch.where(advantages > 0, ok_pos, ok_neg)
    loss = _weighted(-advantages * truncated * log_probs * inside.to(log_probs.dtype), is_weights)
    stats = _stats(mask, log_ratio.detach(), ratio.detach(), clipped=~inside, clipped_lower=(ratio > cap) & inside)
    return PolicyLossOutput(loss_mat=zero_outside(loss, mask), token_stats=stats)


@register_policy_loss("dppo_tv")
def dppo_tv_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig,
    is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """DPPO-Binary-TV (Qi et al., "Rethinking the Trust Region in LLM RL",
    arXiv:2602.04879; verl's ``dppo_tv``).

    A trust region on the sampled token's probability, not its ratio: with ``p = pi(y_t)``,
    ``q = pi_old(y_t)``, a token is inside when ``p - q <= high`` (``A > 0``) or
    ``p - q >= -low`` (``A <= 0``), where ``low``/``high`` are the clip ratios read as
    TV thresholds. ``L_t = -A_t * sg(min(r_t, clip_ratio_c)) * log pi(y_t) * inside_t``.
    ``clipped`` marks tokens outside the region, ``clipped_lower`` inside tokens whose
    ratio hit ``clip_ratio_c`` (verl's metrics).
    """
    return _dppo(log_probs, old_log_probs, advantages, mask, config, is_weights, "tv")


@register_policy_loss("dppo_kl")
def dppo_kl_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig,
    is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """DPPO-Binary-KL (arXiv:2602.04879; verl's ``dppo_kl``): as ``dppo_tv`` with the
    binary KL ``q log(q/p) + (1-q) log((1-q+1e-8)/(1-p+1e-8))`` as the divergence. A token
    is inside when the KL is ``<= high`` or ``p <= q`` (``A > 0``), resp. ``<= low`` or
    ``p >= q`` (``A <= 0``): only moves in the advantage's direction are bounded."""
    return _dppo(log_probs, old_log_probs, advantages, mask, config, is_weights, "kl")


@register_policy_loss("dro")
def dro_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig,
    is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """DRO, direct reward optimisation with a quadratic log-ratio penalty (verl's ``dro``;
    Richemond et al., arXiv:2405.19107): ``L_t = -(A_t log pi(y_t) - beta / 2 (logp_t -
    old_logp_t)^2)`` with ``beta = dro_beta``: a policy gradient held near the sampling
    policy by a squared penalty instead of a clip. ``approx_kl`` is ``-(logp - old_logp)``
    (verl's ``ppo_kl``); no clamp (verl has none here)."""
    if config.dro_beta is None or config.dro_beta <= 0:
        raise ValueError(f"the dro policy loss needs algorithm.dro_beta > 0, got {config.dro_beta}")
    log_probs, old_log_probs, advantages = finite_inputs(mask, log_probs, old_log_probs, advantages)
    log_ratio = log_probs - old_log_probs
    loss = _weighted(-(advantages * log_probs - 0.5 * config.dro_beta * log_ratio.square()), is_weights)
    stats = _stats(mask, log_ratio.detach(), torch.exp(log_ratio.detach()))
    return PolicyLossOutput(loss_mat=zero_outside(loss, mask), token_stats=stats)
