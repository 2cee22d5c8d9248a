"""Advantage estimators pinned to values computed by hand (see ALGORITHMS.md)."""

from __future__ import annotations

import math

import pytest
import torch
from geartrain.algorithms import (
    AdvantageConfig,
    compute_advantages,
    get_advantage,
    group_stats,
    masked_whiten,
    register_advantage,
)
from geartrain.algorithms.advantages import ADVANTAGES

# Layout as in geartrain.types: columns 0-1 are (left-padded) prompt, 2-5 response (right-padded).
# Row lengths: 3, 1, 4, 2, 2, 4 response tokens; each row's outcome reward sits on its last token.
MASK = torch.tensor(
    [
        [0, 0, 1, 1, 1, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 1, 1],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 1],
    ],
    dtype=torch.float32,
)
SCORES = [1.0, 0.0, 0.0, 2.0, 2.0, 5.0]
# groups are interleaved on purpose: "a" = rows 0, 1, 3; "b" = rows 2, 4; "c" = row 5 alone
GROUPS = ["a", "a", "b", "a", "b", "c"]


def outcome_rewards(scores=SCORES, mask=MASK) -> torch.Tensor:
    rewards = torch.zeros_like(mask)
    for row, score in enumerate(scores):
        last = int(mask[row].nonzero().max())
        rewards[row, last] = score
    return rewards


# by hand:
# group a: scores (1, 0, 2) -> mean 1, unbiased var ((0)^2 + 1 + 1) / 2 = 1, std 1
# group b: scores (0, 2)    -> mean 1, unbiased var (1 + 1) / 1 = 2, std sqrt(2)
# group c: score 5 alone     -> mean 0, std 1
GRPO_BY_HAND = [
    0.0 / (1 + 1e-6),
    -1.0 / (1 + 1e-6),
    -1.0 / (math.sqrt(2) + 1e-6),
    1.0 / (1 + 1e-6),
    1.0 / (math.sqrt(2) + 1e-6),
    5.0 / (1 + 1e-6),
]


def per_row(adv: torch.Tensor, mask: torch.Tensor = MASK) -> list[float]:
    """The advantage of each row, checking it is constant on the mask and 0 outside."""
    values = []
    for row in range(adv.shape[0]):
        on = adv[row][mask[row].bool()]
        assert torch.allclose(on, on[0].expand_as(on)), f"row {row} not constant: {on}"
        assert torch.all(adv[row][~mask[row].bool()] == 0)
        values.append(float(on[0]))
    return values


def test_grpo_groups_ragged_masks_singletons_and_equal_rewards():
    adv, returns = compute_advantages("grpo", outcome_rewards(), MASK, group_ids=GROUPS)
    assert per_row(adv) == pytest.approx(GRPO_BY_HAND, abs=1e-6)
    assert torch.equal(adv, returns)


def test_grpo_equal_rewards_give_zero_and_match_torch_std():
    scores = [2.0, 2.0, 2.0, 0.5, -1.0, 3.0]
    ids = torch.tensor([7, 7, 7, 9, 9, 9])
    adv, _ = compute_advantages("grpo", outcome_rewards(scores), MASK, group_ids=ids)
    rows = per_row(adv)
    assert rows[:3] == [0.0, 0.0, 0.0]
    ref = torch.tensor(scores[3:])
    expected = (ref - ref.mean()) / (ref.std() + 1e-6)  # torch.std is unbiased
    assert rows[3:] == pytest.approx(expected.tolist(), abs=1e-6)


def test_grpo_sums_token_rewards_and_ignores_rewards_outside_mask():
    rewards = torch.zeros_like(MASK)
    rewards[0, 2:5] = torch.tensor([0.25, 0.25, 0.5])  # score 1 spread over row 0's tokens
    rewards[0, 0] = 100.0  # prompt position: not in the mask, ignored
    rewards[1, 2] = 0.0
    rewards[3, 3] = 2.0
    rewards[2, 5], rewards[4, 3], rewards[5, 5] = 0.0, 2.0, 5.0
    adv, _ = compute_advantages("grpo", rewards, MASK, group_ids=GROUPS)
    assert per_row(adv) == pytest.approx(GRPO_BY_HAND, abs=1e-6)


def test_grpo_without_std_and_dr_grpo():
    by_hand = [0.0, -1.0, -1.0, 1.0, 1.0, 5.0]  # score - group mean (singleton mean 0)
    no_std, _ = compute_advantages(
        "grpo", outcome_rewards(), MASK, group_ids=GROUPS, config=AdvantageConfig(norm_by_std=False)
    )
    assert per_row(no_std) == pytest.approx(by_hand, abs=1e-7)
    dr, _ = compute_advantages("dr_grpo", outcome_rewards(), MASK, group_ids=GROUPS)  # norm_by_std ignored
    assert torch.equal(dr, no_std)


def test_rloo_leave_one_out_and_singleton():
    adv, returns = compute_advantages("rloo", outcome_rewards(), MASK, group_ids=GROUPS)
    # a: 1 - (0+2)/2 = 0, 0 - (1+2)/2 = -1.5, 2 - (1+0)/2 = 1.5 ; b: 0 - 2 = -2, 2 - 0 = 2 ; c alone: 5
    assert per_row(adv) == pytest.approx([0.0, -1.5, -2.0, 1.5, 2.0, 5.0], abs=1e-6)
    assert torch.equal(adv, returns)
    equal, _ = compute_advantages("rloo", outcome_rewards([3.0] * 6), MASK, group_ids=[0, 0, 0, 1, 1, 2])
    assert per_row(equal) == [0.0, 0.0, 0.0, 0.0, 0.0, 3.0]


def test_group_stats_single_group_of_one():
    mean, std, count = group_stats(torch.tensor([4.0]), ["x"])
    assert (mean.item(), std.item(), count.item()) == (0.0, 1.0, 1.0)
    adv, _ = compute_advantages("grpo", torch.tensor([[0.0, 4.0]]), torch.tensor([[1.0, 1.0]]), group_ids=["x"])
    assert adv[0].tolist() == pytest.approx([4 / (1 + 1e-6)] * 2)


def _whiten_by_hand(values: list[float]) -> list[float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def test_reinforce_plus_plus_discounted_and_whitened():
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.float32)
    rewards = torch.tensor([[9.0, 0, 0, 1, 0], [0, 0, 0, 0, 2]])  # the 9 sits on a prompt token
    adv, returns = compute_advantages("reinforce_plus_plus", rewards, mask, config=AdvantageConfig(gamma=0.5))
    assert returns.tolist() == [[0, 0.25, 0.5, 1, 0], [0, 0, 0.5, 1, 2]]
    white = _whiten_by_hand([0.25, 0.5, 1, 0.5, 1, 2])
    assert adv[mask.bool()].tolist() == pytest.approx(white, abs=1e-6)
    assert torch.all(adv[~mask.bool()] == 0)


def test_reinforce_plus_plus_carries_the_return_across_a_gap():
    mask = torch.tensor([[1, 0, 1, 1]], dtype=torch.float32)  # token 1 is a tool output
    rewards = torch.tensor([[0.0, 7.0, 0.0, 1.0]])
    _, returns = compute_advantages("reinforce_plus_plus", rewards, mask, config=AdvantageConfig(gamma=0.5))
    assert returns.tolist() == [[0.25, 0.0, 0.5, 1.0]]


def test_reinforce_plus_plus_baseline():
    adv, returns = compute_advantages("reinforce_plus_plus_baseline", outcome_rewards(), MASK, group_ids=GROUPS)
    centred = [0.0, -1.0, -1.0, 1.0, 1.0, 5.0]  # score - group mean, singleton mean 0
    tokens = [c for c, n in zip(centred, MASK.sum(1).int().tolist(), strict=True) for _ in range(n)]
    white = _whiten_by_hand(tokens)
    assert adv[MASK.bool()].tolist() == pytest.approx(white, abs=1e-6)
    assert torch.all(adv[~MASK.bool()] == 0)
    assert torch.equal(adv, returns)


def test_remax_subtracts_greedy_baseline():
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 0, 1, 1, 0]], dtype=torch.float32)
    rewards = torch.tensor([[0.0, 0, 1, 0, 2], [0, 0, 0, 3, 0]])
    adv, returns = compute_advantages("remax", rewards, mask, baselines=torch.tensor([1.0, 4.0]))
    assert returns.tolist() == [[0, 3, 3, 2, 2], [0, 0, 3, 3, 0]]
    assert adv.tolist() == [[0, 2, 2, 1, 1], [0, 0, -1, -1, 0]]


def test_gae_by_hand_without_whitening():
    # one row, rewards (0, 0, 1), values (0.5, 0.6, 0.7), gamma 0.9, lambda 0.8:
    # A2 = 1 - 0.7 = 0.3 ; A1 = 0.9*0.7 - 0.6 + 0.72*0.3 = 0.246 ; A0 = 0.9*0.6 - 0.5 + 0.72*0.246 = 0.21712
    cfg = AdvantageConfig(gamma=0.9, lam=0.8, whiten=False)
    adv, returns = compute_advantages(
        "gae", torch.tensor([[0.0, 0, 1]]), torch.ones(1, 3), values=torch.tensor([[0.5, 0.6, 0.7]]), config=cfg
    )
    assert adv.tolist()[0] == pytest.approx([0.21712, 0.246, 0.3], abs=1e-6)
    assert returns.tolist()[0] == pytest.approx([0.71712, 0.846, 1.0], abs=1e-6)


def test_gae_skips_prompt_padding_and_gaps():
    cfg = AdvantageConfig(gamma=0.9, lam=0.8, whiten=False)
    # column 0 is prompt, column 2 a gap (tool output) with junk value and reward, column 5 padding
    mask = torch.tensor([[0, 1, 0, 1, 1, 0]], dtype=torch.float32)
    values = torch.tensor([[3.0, 0.5, 9.0, 0.6, 0.7, 4.0]])
    rewards = torch.tensor([[2.0, 0.0, 5.0, 0.0, 1.0, 6.0]])
    adv, returns = compute_advantages("gae", rewards, mask, values=values, config=cfg)
    assert adv.tolist()[0] == pytest.approx([0, 0.21712, 0, 0.246, 0.3, 0], abs=1e-6)
    assert returns.tolist()[0] == pytest.approx([0, 0.71712, 0, 0.846, 1.0, 0], abs=1e-6)


def test_gae_whitens_advantages_but_not_returns():
    cfg = AdvantageConfig(gamma=1.0, lam=1.0)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    values = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]])
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    adv, returns = compute_advantages("gae", rewards, mask, values=values, config=cfg)
    # gamma = lambda = 1: A_t = return-to-go - V_t
    raw = [0.5, 0.5, 3.0, 3.0, 3.0]
    assert returns[mask.bool()].tolist() == pytest.approx([1.0, 1.0, 3.0, 3.0, 3.0])
    assert adv[mask.bool()].tolist() == pytest.approx(_whiten_by_hand(raw), abs=1e-6)
    assert adv[0, 2] == 0


def test_masked_whiten_one_token_is_zero_not_nan():
    out = masked_whiten(torch.tensor([[5.0, 1.0]]), torch.tensor([[1.0, 0.0]]))
    assert out[0, 0] == 0


def test_estimators_need_their_inputs():
    r, m = torch.zeros(2, 2), torch.ones(2, 2)
    for name, needs in [("gae", "values"), ("grpo", "group_ids"), ("rloo", "group_ids"), ("remax", "baselines")]:
        with pytest.raises(ValueError, match=needs):
            compute_advantages(name, r, m)
    with pytest.raises(ValueError, match="3 entries for a batch of 2"):
        compute_advantages("grpo", r, m, group_ids=[0, 1, 2])


def test_registry_user_estimator_and_errors():
    @register_advantage("test_constant")
    def constant(token_rewards, mask, *, group_ids=None, values=None, baselines=None, config):
        return mask * 2.0, mask * 3.0

    try:
        adv, ret = compute_advantages("test_constant", torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]))
        assert adv.tolist() == [[2.0, 0.0]] and ret.tolist() == [[3.0, 0.0]]
        assert get_advantage("test_constant") is constant
        with pytest.raises(ValueError, match="already registered"):
            register_advantage("test_constant")(lambda *a, **k: None)
    finally:
        ADVANTAGES._entries.pop("test_constant")
    with pytest.raises(KeyError, match="registered: .*gae.*grpo"):
        get_advantage("nope")
    assert {"gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"} <= set(
        ADVANTAGES.names()
    )
