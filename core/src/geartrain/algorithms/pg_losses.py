"""Policy losses beyond PPO clip: plain REINFORCE, GPG, CISPO, SAPO, GMPO, Clip-Cov,
KL-Cov and DPPO (Binary-TV / Binary-KL), registered under verl 0.9's names.

Each has the call signature of :class:`geartrain.algorithms.PolicyLoss` and returns a
per-token ``loss_mat`` (zero outside the mask) plus detached per-token statistics. Their
knobs live in :class:`~geartrain.algorithms.PolicyLossConfig` (``clip_ratio*``,
``clip_ratio_c``, ``tau_pos``/``tau_neg``, ``clip_cov_*``, ``kl_cov_*``).

Where verl fixes the aggregation of a loss (SAPO and GMPO average per sequence whatever
``loss_agg_mode`` says), the output's ``agg_mode`` carries it and the actor loss obeys it.
"""

from __future__ import annotations

import torch

from geartrain.algorithms.masked import masked_mean
from geartrain.algorithms.policy_losses import (
    PolicyLossConfig,
    PolicyLossOutput,
    _finite_inputs,
    _zero_outside,
    register_policy_loss,
)


def _log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor) -> torch.Tensor:
    """``logp - old_logp`` clamped to ``±20`` (verl's clamp before ``exp``)."""
    return torch.clamp(log_probs - old_log_probs, -20.0, 20.0)


def _stats(
    mask: torch.Tensor, log_ratio: torch.Tensor, ratio: torch.Tensor, **flags: torch.Tensor
) -> dict[str, torch.Tensor]:
    stats = {name: _zero_outside(flag.to(ratio.dtype), mask).detach() for name, flag in flags.items()}
    stats["approx_kl"] = _zero_outside(-log_ratio, mask).detach()
    stats["ratio"] = _zero_outside(ratio, mask).detach()
    return stats


def _weighted(loss: torch.Tensor, is_weights: torch.Tensor | None) -> torch.Tensor:
    return loss if is_weights is None else loss * is_weights.detach()


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
    log_probs, old_log_probs, advantages = _finite_inputs(mask, log_probs, old_log_probs, advantages)
    log_ratio = _log_ratio(log_probs, old_log_probs).detach()
    loss = _weighted(-advantages * log_probs, is_weights)
    return PolicyLossOutput(
        loss_mat=_zero_outside(loss, mask), token_stats=_stats(mask, log_ratio, torch.exp(log_ratio))
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

    ``r = exp(clamp(logp - old, ±20))``, ``L_t = -sg(clip(r, 1 - low, 1 + high)) * A_t *
    log pi(y_t)``: every token keeps a gradient, scaled by its clipped, detached ratio
    (verl's ``cispo``). ``clipped`` marks tokens whose ratio was clipped."""
    log_probs, old_log_probs, advantages = _finite_inputs(mask, log_probs, old_log_probs, advantages)
    log_ratio = _log_ratio(log_probs, old_log_probs)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - config.low, 1 + config.high)
    loss = _weighted(-clipped_ratio.detach() * advantages * log_probs, is_weights)
    stats = _stats(mask, log_ratio, ratio, clipped=clipped_ratio != ratio)
    return PolicyLossOutput(loss_mat=_zero_outside(loss, mask), token_stats=stats)


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
    log_probs, old_log_probs, advantages = _finite_inputs(mask, log_probs, old_log_probs, advantages)
    log_ratio = _log_ratio(log_probs, old_log_probs)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, config.tau_pos, config.tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = _weighted(-gate * advantages, is_weights)
    return PolicyLossOutput(
        loss_mat=_zero_outside(loss, mask), token_stats=_stats(mask, log_ratio, ratio), agg_mode="seq-mean-token-mean"
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
    log_probs, old_log_probs, advantages = _finite_inputs(mask, log_probs, old_log_probs, advantages)
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
    return PolicyLossOutput(loss_mat=_zero_outside(loss, mask), token_stats=stats, agg_mode="seq-mean-token-mean")


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
    log_probs, old_log_probs, advantages = _finite_inputs(mask, log_probs, old_log_probs, advantages)
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
    return PolicyLossOutput(loss_mat=_zero_outside(loss, mask), token_stats=stats)


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
    ties: the lowest flat index first). ``clipped`` marks the penalised tokens.
    """
    log_probs, old_log_probs, advantages = _finite_inputs(mask, log_probs, old_log_probs, advantages)
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
    return PolicyLossOutput(loss_mat=_zero_outside(_weighted(loss, is_weights), mask), token_stats=stats)


def _dppo(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig,
    is_weights: torch.Tensor | None,
    divergence: str,
) -> PolicyLossOutput:
    log_probs, old_log_probs, advantages = _finite_inputs(mask, log_probs, old_log_probs, advantages)
    log_ratio = _log_ratio(log_probs, old_log_probs)
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
    return PolicyLossOutput(loss_mat=_zero_outside(loss, mask), token_stats=stats)


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
