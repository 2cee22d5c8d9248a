"""KL estimators, the KL reward penalty and controllers, and the truncated-IS correction."""

from __future__ import annotations

import math

import pytest
import torch
from geartrain.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_estimate,
    make_kl_controller,
    mismatch_metrics,
    truncated_is_weights,
)

LOGP = torch.tensor([[0.0, -1.0, -2.0]], dtype=torch.float64)
REF = torch.tensor([[-1.0, -1.0, 0.0]], dtype=torch.float64)  # d = logp - ref = (1, 0, -2)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("k1", [1.0, 0.0, -2.0]),
        ("kl", [1.0, 0.0, -2.0]),
        ("k2", [0.5, 0.0, 2.0]),
        ("mse", [0.5, 0.0, 2.0]),
        ("k3", [math.exp(-1) - 1 + 1, 0.0, math.exp(2) - 1 - 2]),
        ("low_var_kl", [math.exp(-1), 0.0, math.exp(2) - 3]),
        ("abs", [1.0, 0.0, 2.0]),
    ],
)
def test_kl_estimators_by_hand(kind, expected):
    assert kl_estimate(LOGP, REF, kind).tolist()[0] == pytest.approx(expected)


def test_k3_clamps():
    logp = torch.tensor([30.0, -30.0, -3.0, 2.0], dtype=torch.float64)
    out = kl_estimate(logp, torch.zeros(4, dtype=torch.float64), "k3")
    # d=30 -> clamped to 20: exp(-20) + 19 -> 10 ; d=-30 -> -20: exp(20) - 21 -> 10 ; d=-3: e^3 - 4 = 16.09 -> 10
    assert out.tolist() == pytest.approx([10.0, 10.0, 10.0, math.exp(-2) + 1])
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(logp, logp, "k4")


def test_apply_kl_penalty_folds_into_rewards():
    scores = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    logp = torch.tensor([[0.0, -1.0, -1.0, -5.0], [0.0, -0.5, -2.0, 0.0]])
    ref = torch.tensor([[0.0, -1.5, -0.5, 0.0], [0.0, -1.0, -2.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 0]])
    rewards, metrics = apply_kl_penalty(scores, logp, ref, mask, coef=0.1, kind="k1")
    # k1 under the mask: row 0 (0.5, -0.5), row 1 (0.5, 0.0)
    assert rewards.tolist()[0] == pytest.approx([0.0, -0.05, 1.05, 0.0])
    assert rewards.tolist()[1] == pytest.approx([0.0, 1.95, 0.0, 0.0])
    assert metrics["actor/reward_kl_penalty"] == pytest.approx((0.0 + 0.25) / 2)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)


def test_kl_controllers():
    fixed = make_kl_controller("fixed", 0.05)
    fixed.update(100.0, 256)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.05
    ctl = make_kl_controller("adaptive", 0.1, target_kl=6.0, horizon=10000)
    assert isinstance(ctl, AdaptiveKLController)
    ctl.update(9.0, 256)  # error 0.5 clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    ctl.update(5.4, 100)  # error -0.1
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000) * (1 - 0.1 * 100 / 10000))
    resumed = AdaptiveKLController(1.0, 6.0, 10000)
    resumed.load_state_dict(ctl.state_dict())
    assert resumed.value == ctl.value
    with pytest.raises(ValueError, match="target_kl and horizon"):
        make_kl_controller("adaptive", 0.1)


OLD = torch.tensor([[-1.0, -2.0, -0.5, 0.0]], dtype=torch.float64)
ROLLOUT = torch.tensor([[-1.1, -1.0, -3.0, -9.0]], dtype=torch.float64)  # old - rollout = 0.1, -1, 2.5, (pad)
MASK = torch.tensor([[1, 1, 1, 0]])


def test_truncated_is_weights():
    old = OLD.clone().requires_grad_(True)
    w = truncated_is_weights(old, ROLLOUT, MASK, cap=2.0)
    assert w.tolist()[0] == pytest.approx([math.exp(0.1), math.exp(-1), 2.0, 0.0])
    assert not w.requires_grad


def test_mismatch_metrics():
    m = mismatch_metrics(OLD, ROLLOUT, MASK, cap=2.0)
    k3 = [math.exp(0.1) - 1 - 0.1, math.exp(-1), math.exp(2.5) - 1 - 2.5]  # d = rollout - old = -0.1, 1, -2.5
    assert m["rollout_mismatch/mean_abs_diff"] == pytest.approx(3.6 / 3)
    assert m["rollout_mismatch/max_abs_diff"] == pytest.approx(2.5)
    assert m["rollout_mismatch/kl_k3"] == pytest.approx(sum(k3) / 3)
    assert m["rollout_mismatch/is_weight_mean"] == pytest.approx((math.exp(0.1) + math.exp(-1) + math.exp(2.5)) / 3)
    assert m["rollout_mismatch/truncated_frac"] == pytest.approx(1 / 3)
    empty = mismatch_metrics(OLD, ROLLOUT, torch.zeros_like(MASK))
    assert set(empty.values()) == {0.0}
