"""The optimal token baseline (OTB): a baseline per token position, weighted by how much
gradient variance each trajectory has built up by then (verl's ``optimal_token_baseline``
and its tool-interleaved multi-turn form ``tir_optimal_token_baseline``).

For a token at step ``t`` of a response, with ``G_t`` its return-to-go (undiscounted) and

* ``w_j = (1 - 2 π(y_j) + Σ_v π(v)²) · ρ_j²`` the squared norm of the score function of
  step ``j`` (``π(y_j) = exp(old_log_probs)``, ``Σ_v π(v)²`` = ``sum_pi_squared`` from the
  engine, ``ρ_j`` the rollout importance weight, 1 without one),
* ``W_t = Σ_{j ≤ t} w_j`` over the response's tokens (the path-variance proxy),

the baseline of a prompt's group at step ``t`` is ``B_t = Σ_i G_{i,t} W_{i,t} / (Σ_i W_{i,t} +
1e-8)`` over the group's trajectories that have a token there, and ``A_t = G_t − B_t``.

The two forms differ only in what "step ``t``" is:

* ``optimal_token_baseline``: the ``t``-th column of the response (counted from the row's
  first response token; tool outputs inside the response still take up columns), and every
  row of the group counts towards its size (an empty row too);
* ``tir_optimal_token_baseline``: the ``t``-th *model* token (positions outside the mask are
  skipped, so turn boundaries need not line up), and empty rows are left out of the group.

A group of one trajectory gets no baseline (``A = G``). ``handle_zero_tail``: when one
trajectory of a group is strictly the longest, its baseline past the second-longest
length is 0 (a baseline from itself alone would cancel its return); off by default for
the single-turn form, on for the multi-turn form (verl's defaults).
"""

from __future__ import annotations

import torch

from geartrain.algorithms.advantages import (
    AdvantageConfig,
    GroupIds,
    _float,
    _require,
    group_index,
    register_advantage,
)

EPSILON = 1e-8
"""Added to the baseline's denominator (verl's default)."""


def path_variance(
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    mask: torch.Tensor,
    is_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """``W_t``: the running sum over the masked tokens of ``(1 - 2π + Σπ²) ρ²`` ``[B, T]``
    (held over positions outside the mask, 0 before the first)."""
    m = mask.bool()
    w = 1.0 - 2.0 * torch.exp(_float(old_log_probs)) + _float(sum_pi_squared)
    if is_weights is not None:
        w = w * _float(is_weights) ** 2
    return torch.where(m, w, torch.zeros_like(w)).cumsum(dim=-1)


def _response_frame(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns of each row counted from its first masked column: ``(index [B, T], valid
    [B, T])``; ``index[b, j]`` is the column of step ``j`` of row ``b``."""
    batch, width = mask.shape
    has = mask.bool().any(dim=-1)
    start = torch.where(has, mask.bool().int().argmax(dim=-1), torch.zeros_like(has, dtype=torch.long))
    index = start.unsqueeze(-1) + torch.arange(width, device=mask.device)
    valid = index < width
    return index.clamp(max=width - 1), valid


def _model_token_frame(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The masked columns of each row in order: ``(index [B, T], valid [B, T])``;
    ``index[b, k]`` is the column of the ``k``-th masked token of row ``b``."""
    m = mask.bool()
    index = torch.sort((~m).to(torch.int8), dim=-1, stable=True).indices
    valid = torch.arange(m.shape[1], device=m.device) < m.sum(dim=-1, keepdim=True)
    return index, valid


def _otb(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: GroupIds,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    is_weights: torch.Tensor | None,
    *,
    multi_turn: bool,
    handle_zero_tail: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    rewards = _float(token_rewards)
    m = mask.bool()
    zero = torch.zeros_like(rewards)
    returns = torch.where(m, rewards, zero).flip(-1).cumsum(-1).flip(-1)
    weights = None if is_weights is None else is_weights.to(rewards.device)
    cumulative = path_variance(old_log_probs.to(rewards.device), sum_pi_squared.to(rewards.device), m, weights)
    cumulative = cumulative.to(rewards.dtype)  # the inputs may come in another float dtype
    index, valid = (_model_token_frame if multi_turn else _response_frame)(m)
    # everything below is in the frame: column j of a row is its step j
    in_mask = valid & m.gather(1, index)
    f_returns = torch.where(in_mask, returns.gather(1, index), zero)
    f_weight = torch.where(in_mask, cumulative.gather(1, index), zero)
    lengths = m.sum(dim=-1)
    groups, n_groups = group_index(group_ids, rewards.shape[0])
    groups = groups.to(rewards.device)
    member = lengths > 0 if multi_turn else torch.ones_like(lengths, dtype=torch.bool)
    size = torch.zeros(n_groups, dtype=torch.long, device=rewards.device).index_add_(0, groups, member.long())
    numerator = torch.zeros(n_groups, rewards.shape[1], dtype=rewards.dtype, device=rewards.device)
    denominator = numerator.clone()
    numerator.index_add_(0, groups, f_returns * f_weight)
    denominator.index_add_(0, groups, f_weight)
    baseline = (numerator / (denominator + EPSILON))[groups]
    baseline = torch.where((size[groups] > 1).unsqueeze(-1), baseline, torch.zeros_like(baseline))
    if handle_zero_tail:
        for g in range(n_groups):
            rows = torch.nonzero((groups == g) & member, as_tuple=True)[0]
            if len(rows) < 2:
                continue
            ranked = torch.sort(lengths[rows], descending=True).values
            longest, second = int(ranked[0]), int(ranked[1])
            if longest > second:
                baseline[rows[lengths[rows] == longest], second:] = 0.0
    f_advantages = torch.where(in_mask, f_returns - baseline, zero)
    # back to the batch's columns (steps past a row's width land in a spare column)
    spare = torch.where(valid, index, torch.full_like(index, rewards.shape[1]))
    advantages = torch.zeros(rewards.shape[0], rewards.shape[1] + 1, dtype=rewards.dtype, device=rewards.device)
    advantages.scatter_(1, spare, f_advantages)
    advantages = torch.where(m, advantages[:, :-1], zero)
    return advantages, torch.where(m, returns, zero)


def _inputs(
    name: str, group_ids: GroupIds | None, old_log_probs: torch.Tensor | None, sum_pi_squared: torch.Tensor | None
) -> None:
    _require("group_ids", group_ids, name)
    _require("old_log_probs", old_log_probs, name)
    _require("sum_pi_squared", sum_pi_squared, name)


@register_advantage("optimal_token_baseline")
@torch.no_grad()
def optimal_token_baseline(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_ids: GroupIds | None = None,
    values: torch.Tensor | None = None,
    baselines: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    config: AdvantageConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB, single-turn (verl's ``compute_optimal_token_baseline_advantage``; see the module
    docstring): ``G_t - B_t`` with one baseline per response column and prompt group.

    Needs ``group_ids``, ``old_log_probs`` and ``sum_pi_squared`` (``[B, T]``, aligned like
    the rewards); ``is_weights`` (rollout importance weights, ``[B, T]``) scale each step's
    variance by ``ρ²``. ``config.otb_handle_zero_tail`` (``None``: off). ``returns`` is the
    return-to-go. Both are 0 outside ``mask``."""
    _inputs("optimal_token_baseline", group_ids, old_log_probs, sum_pi_squared)
    assert group_ids is not None and old_log_probs is not None and sum_pi_squared is not None
    zero_tail = config.otb_handle_zero_tail
    return _otb(
        token_rewards,
        mask,
        group_ids,
        old_log_probs,
        sum_pi_squared,
        is_weights,
        multi_turn=False,
        handle_zero_tail=bool(zero_tail) if zero_tail is not None else False,
    )


@register_advantage("tir_optimal_token_baseline")
@torch.no_grad()
def tir_optimal_token_baseline(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_ids: GroupIds | None = None,
    values: torch.Tensor | None = None,
    baselines: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    config: AdvantageConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB for tool-interleaved multi-turn responses (verl's
    ``compute_multi_turn_optimal_token_baseline_advantage``; see the module docstring): one
    baseline per model-token index (tool outputs, outside ``mask``, are skipped) and prompt
    group, empty rows left out of their group. Inputs as :func:`optimal_token_baseline`;
    ``config.otb_handle_zero_tail`` (``None``: on)."""
    _inputs("tir_optimal_token_baseline", group_ids, old_log_probs, sum_pi_squared)
    assert group_ids is not None and old_log_probs is not None and sum_pi_squared is not None
    zero_tail = config.otb_handle_zero_tail
    return _otb(
        token_rewards,
        mask,
        group_ids,
        old_log_probs,
        sum_pi_squared,
        is_weights,
        multi_turn=True,
        handle_zero_tail=bool(zero_tail) if zero_tail is not None else True,
    )


for _estimator in (optimal_token_baseline, tir_optimal_token_baseline):
    _estimator.needs_sum_pi_squared = True  # type: ignore[attr-defined]
