"""Advantage estimators: GAE, GRPO, Dr. GRPO, RLOO, REINFORCE++ (and its baseline variant),
ReMax, behind one call signature and a registry users extend.

Every estimator is called as::

    advantages, returns = estimator(
        token_rewards,          # [B, T] float, reward of each token (0 outside the mask)
        mask,                   # [B, T] 0/1, the response tokens (response_mask / loss_mask)
        group_ids=...,          # B hashables or a [B] tensor: samples of one prompt share an id
        values=...,             # [B, T] critic values V(x_<t) aligned like the rewards (GAE)
        baselines=...,          # [B] a reward to subtract per sample (ReMax: the greedy reward)
        config=AdvantageConfig(...),
    )

Both outputs are ``[B, T]`` float tensors, zero outside ``mask``. Tensors follow the
layout of :mod:`geartrain.types` (aligned to ``input_ids``), but an estimator only looks at
positions relative to the mask, so any ``[B, L]`` with a mask works, e.g. response-only
tensors. Positions outside the mask are skipped: a mask with gaps (tool outputs inside a
multi-turn response) carries values and accumulated returns across the gap.

Outcome estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline) use the sequence score =
the sum of a row's token rewards under the mask, and return ``returns == advantages``.

An estimator that needs ``baselines`` (ReMax: the reward of a greedy response) says so
with a ``needs_baselines = True`` attribute; the trainer then generates and scores one
greedy response per prompt and passes its reward. One that needs the reward's components
(GDPO: one per reward term) declares ``needs_reward_components = True`` and receives them
as ``components=`` ``[B, K]``. One that needs the policy's distribution at each token
(the optimal token baseline) declares ``needs_sum_pi_squared = True`` and receives
``old_log_probs``, ``sum_pi_squared`` (``Σ_v π(v)²`` per token, from the engine) and
``is_weights`` (the rollout importance weights, or ``None``), all ``[B, T]``.

Add your own with :func:`register_advantage`::

    @register_advantage("my_est")
    def my_est(token_rewards, mask, *, group_ids=None, values=None, baselines=None, config):
        ...
        return advantages, returns
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from geartrain.algorithms.masked import masked_whiten
from geartrain.algorithms.registry import Registry

GroupIds = Sequence[Hashable] | torch.Tensor


@dataclass(kw_only=True, slots=True)
class AdvantageConfig:
    """Knobs of the built-in estimators (each reads only the ones it needs)."""

    gamma: float = 1.0
    """Discount (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE's lambda."""
    norm_by_std: bool = True
    """GRPO: divide by the group std. ``False`` gives Dr. GRPO's advantage."""
    epsilon: float = 1e-6
    """Added to the group std (not the variance) before dividing (GRPO)."""
    whiten: bool = True
    """GAE: whiten advantages over the batch (returns are taken before whitening)."""
    gpg_f_norm: float = 1.0
    """GPG: the advantage is divided by this (verl's ``f_norm``, default 1)."""
    gdpo_weights: tuple[float, ...] | None = None
    """GDPO: the weight of each reward component (``None``: 1 each)."""
    unbiased_var: bool = True
    """Whitening (GAE, REINFORCE++ and its baseline variant): the variance's ``N - 1``
    divisor (verl's default); ``False``: the biased ``/N`` variance."""
    otb_handle_zero_tail: bool | None = None
    """Optimal token baseline: no baseline past the second-longest response of a group for
    its single longest one (:mod:`geartrain.algorithms.otb`); ``None``: verl's default,
    off for ``optimal_token_baseline``, on for ``tir_optimal_token_baseline``."""


class AdvantageEstimator(Protocol):
    """The call signature every registered estimator has (see the module docstring)."""

    def __call__(
        self,
        token_rewards: torch.Tensor,
        mask: torch.Tensor,
        *,
        group_ids: GroupIds | None = None,
        values: torch.Tensor | None = None,
        baselines: torch.Tensor | None = None,
        config: AdvantageConfig,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


ADVANTAGES: Registry[AdvantageEstimator] = Registry("advantage estimator")


def register_advantage(name: str, *, override: bool = False) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator registering an estimator under ``name`` (see the module docstring)."""
    return ADVANTAGES.register(name, override=override)


def get_advantage(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``; ``KeyError`` lists the known names."""
    return ADVANTAGES.get(name)


def compute_advantages(
    name: str,
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: AdvantageConfig | None = None,
    group_ids: GroupIds | None = None,
    values: torch.Tensor | None = None,
    baselines: torch.Tensor | None = None,
    components: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Look up ``name`` and call it; ``config`` defaults to :class:`AdvantageConfig()`.
    ``components`` (``[B, K]``, the reward's components per sample) reach only estimators
    that declare ``needs_reward_components``; ``old_log_probs``, ``sum_pi_squared`` and
    ``is_weights`` only those that declare ``needs_sum_pi_squared``."""
    estimator = get_advantage(name)
    extra: dict[str, torch.Tensor | None] = {"components": components} if components is not None else {}
    if getattr(estimator, "needs_sum_pi_squared", False):
        extra.update(old_log_probs=old_log_probs, sum_pi_squared=sum_pi_squared, is_weights=is_weights)
    return estimator(
        token_rewards,
        mask,
        group_ids=group_ids,
        values=values,
        baselines=baselines,
        config=config or AdvantageConfig(),
        **extra,
    )


# --------------------------------------------------------------------------- helpers
def group_index(group_ids: GroupIds, batch_size: int) -> tuple[torch.Tensor, int]:
    """Map ``group_ids`` (any hashables, or a tensor) to dense indices ``[B]`` in order of
    first appearance; returns ``(index, num_groups)``."""
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if len(ids) != batch_size:
        raise ValueError(f"group_ids has {len(ids)} entries for a batch of {batch_size}")
    dense: dict[Hashable, int] = {}
    index = [dense.setdefault(g, len(dense)) for g in ids]
    return torch.tensor(index, dtype=torch.long), len(dense)


def group_stats(scores: torch.Tensor, group_ids: GroupIds) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample ``(group mean, unbiased group std, group size)`` for scores ``[B]``.

    A group of one has mean 0 and std 1 (so its sample keeps its own score), the
    convention verl uses.
    """
    index, n_groups = group_index(group_ids, scores.shape[0])
    index = index.to(scores.device)
    count = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, index, torch.ones_like(scores)
    )
    total = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, index, scores)
    mean = total / count
    sq = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, index, (scores - mean[index]) ** 2
    )
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[index], std[index], count[index]


def sequence_scores(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of each row's token rewards under the mask: ``[B, T] -> [B]``."""
    return torch.where(mask.bool(), token_rewards, torch.zeros_like(token_rewards)).sum(dim=-1)


def _require(name: str, value: object, estimator: str) -> None:
    if value is None:
        raise ValueError(f"advantage estimator '{estimator}' needs {name}=...")


def _float(x: torch.Tensor) -> torch.Tensor:
    return x.float() if not x.is_floating_point() or x.dtype in (torch.float16, torch.bfloat16) else x


# --------------------------------------------------------------------------- estimators
@register_advantage("gae")
@torch.no_grad()
def gae(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_ids: GroupIds | None = None,
    values: torch.Tensor | None = None,
    baselines: torch.Tensor | None = None,
    config: AdvantageConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (needs ``values``).

    Walking backwards over the masked tokens only: ``delta_t = r_t + gamma * V_next - V_t``,
    ``A_t = delta_t + gamma * lam * A_next``, where ``next`` is the next *masked* token
    (0 after the last one). ``returns = A + V`` before whitening; then, with
    ``config.whiten``, ``A`` is whitened over all masked tokens of the batch (unbiased
    variance, ``rsqrt(var + 1e-8)``). Rewards outside the mask are ignored.
    """
    _require("values", values, "gae")
    assert values is not None
    rewards, values = _float(token_rewards), _float(values).to(token_rewards.device)
    m = mask.to(rewards.dtype)
    batch, length = rewards.shape
    next_value = torch.zeros(batch, dtype=rewards.dtype, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(length)):
        delta = rewards[:, t] + config.gamma * next_value - values[:, t]
        adv_t = delta + config.gamma * config.lam * next_adv
        keep = m[:, t]
        next_value = keep * values[:, t] + (1 - keep) * next_value
        next_adv = keep * adv_t + (1 - keep) * next_adv
        advantages[:, t] = adv_t
    advantages = advantages * m
    returns = (advantages + values) * m
    if config.whiten:
        advantages = masked_whiten(advantages, mask, unbiased=config.unbiased_var) * m
    return advantages, returns


def _grpo(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: GroupIds | None,
    *,
    norm_by_std: bool,
    epsilon: float,
    name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    _require("group_ids", group_ids, name)
    assert group_ids is not None
    scores = sequence_scores(_float(token_rewards), mask)
    mean, std, _ = group_stats(scores, group_ids)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + epsilon)
    adv = adv.unsqueeze(-1) * mask.to(adv.dtype)
    return adv, adv


@register_advantage("grpo")
@torch.no_grad()
def grpo(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_ids: GroupIds | None = None,
    values: torch.Tensor | None = None,
    baselines: torch.Tensor | None = None,
    config: AdvantageConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: ``(score - group mean) / (group std + epsilon)`` broadcast over the mask.

    The std is ``torch.std``'s unbiased one; ``config.norm_by_std=False`` skips the
    division. A group of one has mean 0 and std 1 (advantage ``score / (1 + eps)``); a
    group of equal scores gets advantage 0.
    """
    return _grpo(token_rewards, mask, group_ids, norm_by_std=config.norm_by_std, epsilon=config.epsilon, name="grpo")


@register_advantage("dr_grpo")
@torch.no_grad()
def dr_grpo(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_ids: GroupIds | None = None,
    values: torch.Tensor | None = None,
    baselines: torch.Tensor | None = None,
    config: AdvantageConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO: ``score - group mean``, never divided by the std (whatever
    ``config.norm_by_std`` says). Pair it with ``seq-mean-token-sum-norm`` aggregation."""
    return _grpo(token_rewards, mask, group_ids, norm_by_std=False, epsilon=config.epsilon, name="dr_grpo")


@register_advantage("rloo")
@torch.no_grad()
def rloo(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_ids: GroupIds | None = None,
    values: torch.Tensor | None = None,
    baselines: torch.Tensor | None = None,
    config: AdvantageConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: ``score - mean of the other samples of the group`` = ``n/(n-1) (score - mean)``.

    Singleton group: there are no other samples, so the baseline is 0 and the advantage is
    the raw score (as verl does; consistent with GRPO's group-of-one mean 0).
    """
    _require("group_ids", group_ids, "rloo")
    assert group_ids is not None
    scores = sequence_scores(_float(token_rewards), mask)
    mean, _, count = group_stats(scores, group_ids)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.ones_like(count))
    adv = (scores - mean) * scale
    adv = adv.unsqueeze(-1) * mask.to(adv.dtype)
    return adv, adv


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return-to-go over the masked tokens (positions outside the mask are skipped, not
    reset: a gap inside a response passes the later return through). Zero outside."""
    m = mask.to(rewards.dtype)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        keep = m[:, t]
        running = keep * (rewards[:, t] + gamma * running) + (1 - keep) * running
        returns[:, t] = running
    return returns * m


@register_advantage("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_ids: GroupIds | None = None,
    values: torch.Tensor | None = None,
    baselines: torch.Tensor | None = None,
    config: AdvantageConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go (``config.gamma``), whitened over all masked
    tokens of the batch (mean, unbiased variance, ``rsqrt(var + 1e-8)``); no group baseline.

    ``returns`` is the un-whitened return-to-go. For a contiguous mask this equals verl;
    verl resets the running return at masked positions, we carry it across gaps.
    """
    returns = _discounted_returns(_float(token_rewards), mask, config.gamma)
    advantages = masked_whiten(returns, mask, unbiased=config.unbiased_var) * mask.to(returns.dtype)
    return advantages, returns


@register_advantage("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_ids: GroupIds | None = None,
    values: torch.Tensor | None = None,
    baselines: torch.Tensor | None = None,
    config: AdvantageConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: ``score - group mean`` (group of one: mean 0) broadcast over
    the mask, then whitened over all masked tokens of the batch like REINFORCE++."""
    _require("group_ids", group_ids, "reinforce_plus_plus_baseline")
    assert group_ids is not None
    scores = sequence_scores(_float(token_rewards), mask)
    mean, _, _ = group_stats(scores, group_ids)
    m = mask.to(scores.dtype)
    centred = (scores - mean).unsqueeze(-1) * m
    adv = masked_whiten(centred, mask, unbiased=config.unbiased_var) * m
    return adv, adv


@register_advantage("remax")
@torch.no_grad()
def remax(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_ids: GroupIds | None = None,
    values: torch.Tensor | None = None,
    baselines: torch.Tensor | None = None,
    config: AdvantageConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: undiscounted return-to-go minus ``baselines`` (``[B]``, the reward of the
    greedy response to the same prompt), on every masked token. ``returns`` is the
    return-to-go."""
    _require("baselines", baselines, "remax")
    assert baselines is not None
    rewards = _float(token_rewards)
    returns = _discounted_returns(rewards, mask, 1.0)
    m = mask.to(rewards.dtype)
    advantages = (returns - baselines.to(rewards).reshape(-1, 1)) * m
    return advantages, returns


remax.needs_baselines = True  # type: ignore[attr-defined]


@register_advantage("grpo_passk")
@torch.no_grad()
def grpo_passk(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_ids: GroupIds | None = None,
    values: torch.Tensor | None = None,
    baselines: torch.Tensor | None = None,
    config: AdvantageConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO for pass@k (Chen et al., arXiv:2503.19595; verl's ``grpo_passk``): only the
    best sample of each group is rewarded, with ``max - second max`` of the group's scores,
    divided by ``(group std + epsilon)`` when ``config.norm_by_std`` (unbiased std); every
    other sample gets 0. Ties for the best give 0. A group needs at least two samples
    (``ValueError`` naming the group otherwise, as verl).
    """
    _require("group_ids", group_ids, "grpo_passk")
    assert group_ids is not None
    scores = sequence_scores(_float(token_rewards), mask)
    index, n_groups = group_index(group_ids, scores.shape[0])
    _, std, _ = group_stats(scores, group_ids)
    adv = torch.zeros_like(scores)
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    for g in range(n_groups):
        rows = torch.nonzero(index == g, as_tuple=True)[0].to(scores.device)
        if len(rows) < 2:
            raise ValueError(f"grpo_passk needs at least 2 samples per group; group {ids[int(rows[0])]!r} has 1")
        top = torch.topk(scores[rows], 2)
        gap = top.values[0] - top.values[1]
        best = rows[top.indices[0]]
        adv[best] = gap / (std[best] + config.epsilon) if config.norm_by_std else gap
    adv = adv.unsqueeze(-1) * mask.to(adv.dtype)
    return adv, adv


@register_advantage("opo")
@torch.no_grad()
def opo(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_ids: GroupIds | None = None,
    values: torch.Tensor | None = None,
    baselines: torch.Tensor | None = None,
    config: AdvantageConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO, on-policy RL with the optimal baseline (Hao et al., arXiv:2505.23585; verl's
    ``opo``): ``score - b`` with the length-weighted group mean
    ``b = sum_j |y_j| score_j / sum_j |y_j|`` (``|y|`` = masked tokens of the row). A group
    of one has baseline 0 (verl). Broadcast over the mask, no std division."""
    _require("group_ids", group_ids, "opo")
    assert group_ids is not None
    scores = sequence_scores(_float(token_rewards), mask)
    lengths = mask.to(scores.dtype).sum(-1)
    index, n_groups = group_index(group_ids, scores.shape[0])
    index = index.to(scores.device)
    zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    weighted = zeros.clone().index_add_(0, index, lengths * scores)
    total_len = zeros.clone().index_add_(0, index, lengths)
    count = zeros.clone().index_add_(0, index, torch.ones_like(scores))
    baseline = torch.where(count > 1, weighted / total_len.clamp(min=1e-12), torch.zeros_like(weighted))
    adv = (scores - baseline[index]).unsqueeze(-1) * mask.to(scores.dtype)
    return adv, adv


@register_advantage("gpg")
@torch.no_grad()
def gpg(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_ids: GroupIds | None = None,
    values: torch.Tensor | None = None,
    baselines: torch.Tensor | None = None,
    config: AdvantageConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG's advantage (Chu et al., arXiv:2504.02546; verl's ``gpg``):
    ``alpha * (score - group mean)`` with ``alpha = B / max(#(score != 0), 1)`` over the
    whole batch of ``B`` samples (the paper's correction for groups that carry no signal),
    divided by ``config.gpg_f_norm`` (verl's ``f_norm``, default 1) rather than the group
    std. A group of one has mean 0."""
    _require("group_ids", group_ids, "gpg")
    assert group_ids is not None
    scores = sequence_scores(_float(token_rewards), mask)
    mean, _, _ = group_stats(scores, group_ids)
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
    adv = (alpha * (scores - mean) / config.gpg_f_norm).unsqueeze(-1) * mask.to(scores.dtype)
    return adv, adv


@register_advantage("gdpo")
@torch.no_grad()
def gdpo(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_ids: GroupIds | None = None,
    values: torch.Tensor | None = None,
    baselines: torch.Tensor | None = None,
    components: torch.Tensor | None = None,
    config: AdvantageConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO, group reward-decoupled normalisation (arXiv:2601.05242; verl's ``gdpo``): each
    reward component ``k`` (``components[:, k]``, e.g. one per reward term) is normalised
    within its group as GRPO does, ``(r_k - mean_G) / (std_G + epsilon)`` (undivided without
    ``norm_by_std``), the results are summed with ``config.gdpo_weights`` (1 each by
    default), broadcast over the response and whitened over the batch's response tokens
    (masked mean and unbiased variance, ``rsqrt(var + 1e-8)``), 0 outside the mask. So a
    component of large variance does not drown the others, as it would in their sum.
    Without ``components`` the sequence score is the only one."""
    _require("group_ids", group_ids, "gdpo")
    assert group_ids is not None
    dtype = _float(token_rewards).dtype
    m = mask.to(dtype)
    parts = components if components is not None else sequence_scores(_float(token_rewards), mask).unsqueeze(-1)
    parts = parts.to(dtype)
    weights = config.gdpo_weights or (1.0,) * parts.shape[1]
    if len(weights) != parts.shape[1]:
        raise ValueError(f"gdpo: {len(weights)} weights for {parts.shape[1]} reward components")
    total = torch.zeros(parts.shape[0], dtype=m.dtype)
    for k, weight in enumerate(weights):
        mean, std, _ = group_stats(parts[:, k], group_ids)
        adv = parts[:, k] - mean
        if config.norm_by_std:
            adv = adv / (std + config.epsilon)
        total = total + weight * adv
    adv = masked_whiten(total.unsqueeze(-1) * m, m, unbiased=True) * m
    return adv, adv


gdpo.needs_reward_components = True  # type: ignore[attr-defined]
