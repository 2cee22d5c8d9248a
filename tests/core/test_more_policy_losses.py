"""The policy losses beyond PPO clip (REINFORCE, GPG, CISPO, SAPO, GMPO, Clip-Cov, KL-Cov,
DPPO-TV/KL), pinned to values worked out by hand from each paper's / verl's formula.

Every case holds a masked-out padding column with junk (``-inf`` log-probs) that must
reach neither the loss nor the gradient.
"""

from __future__ import annotations

import math

import pytest
import torch
from geartrain.algorithms import PolicyLossConfig, aggregate, get_policy_loss
from geartrain.algorithms.losses import ActorLossConfig, make_actor_loss
from geartrain.batch import Batch
from geartrain.types import LossContext

F64 = torch.float64


def tokens(probs, old_probs, adv):
    """One row of tokens with the given new / old probabilities and advantages, plus a
    masked padding column holding junk."""
    logp = torch.tensor([[*(math.log(p) for p in probs), -math.inf]], dtype=F64).requires_grad_(True)
    old = torch.tensor([[*(math.log(q) for q in old_probs), -math.inf]], dtype=F64)
    a = torch.tensor([[*adv, 7.0]], dtype=F64)
    mask = torch.tensor([[1.0] * len(probs) + [0.0]], dtype=F64)
    return logp, old, a, mask


def run(name, logp, old, adv, mask, **cfg):
    out = get_policy_loss(name)(logp, old, adv, mask, config=PolicyLossConfig(**cfg))
    out.loss_mat.sum().backward()
    return out.loss_mat[0].tolist(), logp.grad[0].tolist(), out


@pytest.mark.parametrize("name", ["reinforce", "gpg"])
def test_reinforce_and_gpg_are_minus_advantage_times_log_prob(name):
    logp, old, adv, mask = tokens([0.5, 0.25], [0.9, 0.1], [2.0, -1.0])
    loss, grad, _ = run(name, logp, old, adv, mask)
    # -A log p: -2 ln 0.5 = 2 ln 2; +1 ln 0.25 = -2 ln 2; the old policy plays no part
    assert loss == pytest.approx([2 * math.log(2), -2 * math.log(2), 0.0])
    assert grad == pytest.approx([-2.0, 1.0, 0.0])


def test_reinforce_with_truncated_is_weights():
    logp, old, adv, mask = tokens([0.5, 0.25], [0.5, 0.25], [2.0, -1.0])
    w = torch.tensor([[0.5, 2.0, 9.0]], dtype=F64)
    out = get_policy_loss("reinforce")(logp, old, adv, mask, config=PolicyLossConfig(), is_weights=w)
    assert out.loss_mat[0].tolist() == pytest.approx([math.log(2), -4 * math.log(2), 0.0])


def test_cispo_clips_the_detached_weight_and_keeps_every_gradient():
    # old p = 0.4; ratios 1.5 (above 1.28), 0.5 (below 0.8), 1.1 (inside)
    logp, old, adv, mask = tokens([0.6, 0.2, 0.44], [0.4, 0.4, 0.4], [1.0, -1.0, 2.0])
    loss, grad, out = run("cispo", logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    # -sg(clip r) A log p: -1.28 ln 0.6, +0.8 ln 0.2, -2 * 1.1 ln 0.44
    assert loss == pytest.approx([0.6538567984, -1.2875503299, 1.8061572146, 0.0])
    # gradient -sg(clip r) A: clipped tokens still learn, at the clipped weight
    assert grad == pytest.approx([-1.28, 0.8, -2.2, 0.0])
    assert out.token_stats["clipped"][0].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_sapo_soft_gate_values_gradients_and_sequence_aggregation():
    # ratios 1 (A>0, tau 1), 2 (A>0, tau 1), 0.5 (A<0, tau 1.05)
    logp, old, adv, mask = tokens([0.3, 0.6, 0.1], [0.3, 0.3, 0.2], [1.0, 1.0, -1.0])
    loss, grad, out = run("sapo", logp, old, adv, mask, tau_pos=1.0, tau_neg=1.05)
    # -A (4/tau) sigmoid(tau (r - 1)): -2; -4 sigmoid(1); +(4/1.05) sigmoid(-0.525)
    assert loss == pytest.approx([-2.0, -2.9242343145, 1.4159383303, 0.0])
    # -A * 4 s (1 - s) * r: the plain policy gradient (-A) at r = 1, damped away from it
    assert grad == pytest.approx([-1.0, -1.5728954659, 0.4670699116, 0.0])
    assert out.agg_mode == "seq-mean-token-mean"


def test_gmpo_geometric_mean_ratio_clipped_in_log_space():
    # row 0: A = +1, log-ratios 0.6 (clipped to 0.4), -0.2, then padding
    # row 1: A = -1, log-ratios -0.6 (clipped to -0.4), 0.3, 0.6 (kept: A < 0 only bounds below)
    old = torch.tensor([[-1.0, -2.0, -math.inf], [-1.0, -1.5, -2.0]], dtype=F64)
    d = torch.tensor([[0.6, -0.2, 0.0], [-0.6, 0.3, 0.6]], dtype=F64)
    logp = (old + d).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 5.0], [-1.0, -1.0, -1.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=F64)
    out = get_policy_loss("gmpo")(logp, old, adv, mask, config=PolicyLossConfig(clip_ratio=0.4))
    # L_0 = -exp((0.4 - 0.2) / 2) = -exp(0.1); L_1 = +exp((-0.4 + 0.3 + 0.6) / 3) = exp(1/6)
    assert out.loss_mat.flatten().tolist() == pytest.approx([-1.1051709181] * 2 + [0.0] + [1.1813604129] * 3)
    assert out.agg_mode == "seq-mean-token-mean"
    total = aggregate(out.loss_mat, mask, out.agg_mode)
    assert float(total.detach()) == pytest.approx((-1.1051709181 + 1.1813604129) / 2)
    total.backward()
    # d/dd_t of mean_i(-A_i R_i) = -A_i R_i / (2 n_i) on unclipped tokens, 0 on clipped ones
    assert logp.grad.flatten().tolist() == pytest.approx(
        [0.0, -1.1051709181 / 4, 0.0, 0.0, 1.1813604129 / 6, 1.1813604129 / 6]
    )
    assert out.token_stats["clipped"].tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    # verl's clip fractions count log-ratios outside [-low, high], split by the advantage's sign
    assert out.token_stats["clipped_lower"].tolist() == [[0.0, 0.0, 0.0], [1.0, 0.0, 1.0]]


def cov_case():
    """A = [2, -2, 2, -2] (mean 0), log p = [-0.5, -2.5, -1.5, -1.5] (mean -1.5), so
    cov = (A - 0)(log p + 1.5) = [2, 2, 0, 0]; ratios 1.1, 0.5, 1.0, 1.1."""
    logp = torch.tensor([[-0.5, -2.5, -1.5, -1.5, -math.inf]], dtype=F64).requires_grad_(True)
    ratios = torch.tensor([[1.1, 0.5, 1.0, 1.1, 1.0]], dtype=F64)
    old = logp.detach() - ratios.log()
    adv = torch.tensor([[2.0, -2.0, 2.0, -2.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]], dtype=F64)
    return logp, old, adv, mask


def test_clip_cov_cuts_the_gradient_of_unclipped_high_covariance_tokens():
    logp, old, adv, mask = cov_case()
    loss, grad, out = run(
        "clip_cov", logp, old, adv, mask, clip_ratio=0.2, clip_cov_ratio=0.5, clip_cov_lb=1.0, clip_cov_ub=5.0
    )
    # token 0 (cov 2, unclipped) is cut; token 1 (cov 2) is already clipped by the ratio
    # (A < 0, r = 0.5 -> -A * 0.8 = 1.6) so it is no candidate; tokens 2, 3 have cov 0.
    assert loss == pytest.approx([0.0, 1.6, -2.0, 2.2, 0.0])
    assert grad == pytest.approx([0.0, 0.0, -2.0, 2.2, 0.0])
    assert out.token_stats["clipped"][0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    # an upper bound below the covariance: nothing is cut, plain PPO clip remains
    logp, old, adv, mask = cov_case()
    loss, _, _ = run("clip_cov", logp, old, adv, mask, clip_ratio=0.2, clip_cov_ratio=0.5, clip_cov_ub=1.5)
    assert loss == pytest.approx([-2.2, 1.6, -2.0, 2.2, 0.0])


def test_kl_cov_penalises_the_top_covariance_tokens():
    logp, old, _, mask = cov_case()
    # A = [2, -2, 2, -1] (mean 0.25); log p - mean = [1, -1, 0, 0] with log p as below
    logp = torch.tensor([[-0.5, -2.0, -1.5, -2.0, -math.inf]], dtype=F64).requires_grad_(True)
    old = logp.detach() - torch.tensor([[1.1, 0.5, 1.0, 1.2, 1.0]], dtype=F64).log()
    adv = torch.tensor([[2.0, -2.0, 2.0, -1.0, 9.0]], dtype=F64)
    # log p - mean(-1.5) = [1, -0.5, 0, -0.5]; cov = [1.75, 1.125, 0, 0.625]; top 2: tokens 0, 1
    loss, grad, out = run("kl_cov", logp, old, adv, mask, kl_cov_ratio=0.5, kl_cov_coef=0.1)
    # -A r (+ 0.1 |ln r| on tokens 0 and 1)
    assert loss == pytest.approx([-2.2 + 0.1 * math.log(1.1), 1.0 + 0.1 * math.log(2), -2.0, 1.2, 0.0])
    assert grad == pytest.approx([-2.2 + 0.1, 1.0 - 0.1, -2.0, 1.2, 0.0])
    assert out.token_stats["clipped"][0].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_dppo_tv_masks_tokens_whose_probability_moved_too_far():
    # (p, q, A): inside (+0.1); outside (+0.3, A>0); outside (-0.25, A<0); inside with r = 4 > c = 3
    logp, old, adv, mask = tokens([0.6, 0.6, 0.25, 0.4], [0.5, 0.3, 0.5, 0.1], [1.0, 1.0, -1.0, -1.0])
    loss, grad, out = run("dppo_tv", logp, old, adv, mask, clip_ratio=0.2, clip_ratio_c=3.0)
    # -A sg(min(r, 3)) log p on inside tokens: -1.2 ln 0.6; 0; 0; +3 ln 0.4
    assert loss == pytest.approx([0.6129907485, 0.0, 0.0, -2.7488721956, 0.0])
    assert grad == pytest.approx([-1.2, 0.0, 0.0, 3.0, 0.0])
    assert out.token_stats["clipped"][0].tolist() == [0.0, 1.0, 1.0, 0.0, 0.0]
    assert out.token_stats["clipped_lower"][0].tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]


def test_dppo_kl_bounds_the_binary_kl_in_the_advantages_direction():
    # binary KL(q || p): 0.0204 (inside); 0.1838 with p > q, A > 0 (outside);
    # 0.192 but p < q with A > 0 (inside: moving against the advantage is not bounded);
    # 0.1438 with p < q, A < 0 (outside); 0.2263 but p > q with A < 0 (inside, r = 4 -> 3)
    logp, old, adv, mask = tokens([0.6, 0.6, 0.3, 0.25, 0.4], [0.5, 0.3, 0.6, 0.5, 0.1], [1.0, 1.0, 1.0, -1.0, -1.0])
    loss, grad, out = run("dppo_kl", logp, old, adv, mask, clip_ratio=0.05, clip_ratio_c=3.0)
    assert loss == pytest.approx([0.6129907485, 0.0, 0.6019864022, 0.0, -2.7488721956, 0.0])
    assert grad == pytest.approx([-1.2, 0.0, -0.5, 0.0, 3.0, 0.0])
    assert out.token_stats["clipped"][0].tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 0.0]


def test_actor_loss_obeys_a_loss_fixed_aggregation():
    """SAPO is defined with seq-mean-token-mean: the configured token-mean must not apply."""
    logp = torch.tensor([[math.log(0.5), math.log(0.5), math.log(0.5)], [math.log(0.5), 0.0, 0.0]], dtype=F64)
    batch = Batch(
        {
            "loss_mask": torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=F64),
            "old_log_probs": logp.clone(),
            "advantages": torch.tensor([[1.0, 1.0, 1.0], [-3.0, 0.0, 0.0]], dtype=F64),
        }
    )
    loss_fn = make_actor_loss(ActorLossConfig(policy_loss="sapo", loss_agg_mode="token-mean"))
    loss, _ = loss_fn({"log_probs": logp}, batch, LossContext(global_tokens=4, global_sequences=2))
    # r = 1 everywhere: gate 4/tau * 1/2; row 0: -2 per token (mean -2); row 1: +3 * 2/1.05
    assert float(loss) == pytest.approx((-2.0 + 3.0 * 2 / 1.05) / 2)


@pytest.mark.parametrize("name", ["ppo", "reinforce", "cispo", "sapo", "dppo_tv"])
def test_every_ratio_loss_clamps_the_log_ratio_at_the_configured_bound(name):
    # log(new/old) = log(0.9 / 0.09) = ln 10 = 2.30; with the clamp at 1 the ratio each loss
    # reports (and, for the ratio-based ones, uses) is e^1, not 10.
    logp, old, adv, mask = tokens([0.9], [0.09], [1.0])
    _, _, out = run(name, logp, old, adv, mask, log_ratio_clamp=1.0, clip_ratio=100.0, clip_ratio_c=None)
    assert out.token_stats["ratio"][0, 0].item() == pytest.approx(math.e, rel=1e-12)
    assert out.token_stats["approx_kl"][0, 0].item() == pytest.approx(-1.0, rel=1e-12)
    if name == "sapo":  # the gate sees the clamped ratio: (4 / tau) sigmoid(tau (e - 1)), A > 0
        assert out.loss_mat[0, 0].item() == pytest.approx(-4.0 * (1 / (1 + math.exp(-(math.e - 1)))), rel=1e-12)


def test_kl_cov_logs_ppo_kl_as_the_mean_absolute_log_ratio():
    # verl's kl_cov reports actor/ppo_kl = masked mean of |logp - old|, not of -(logp - old)
    logp, old, adv, mask = tokens([0.5, 0.25], [0.9, 0.1], [1.0, -1.0])
    _, _, out = run("kl_cov", logp, old, adv, mask, kl_cov_ratio=0.5)
    d = [math.log(0.5 / 0.9), math.log(0.25 / 0.1)]  # -0.588, 0.916
    assert out.metrics(mask)["actor/ppo_kl"] == pytest.approx((abs(d[0]) + abs(d[1])) / 2, rel=1e-12)


def test_dro_is_the_policy_gradient_with_a_quadratic_log_ratio_penalty():
    logp, old, adv, mask = tokens([0.5, 0.25], [0.9, 0.1], [2.0, -1.0])
    loss, grad, out = run("dro", logp, old, adv, mask, dro_beta=0.5)
    d = [math.log(0.5 / 0.9), math.log(0.25 / 0.1)]
    # verl: -(A logp - beta / 2 d^2); gradient in logp: -(A - beta d)
    assert loss == pytest.approx(
        [-(2.0 * math.log(0.5) - 0.25 * d[0] ** 2), -(-1.0 * math.log(0.25) - 0.25 * d[1] ** 2), 0.0]
    )
    assert grad == pytest.approx([-(2.0 - 0.5 * d[0]), -(-1.0 - 0.5 * d[1]), 0.0])
    assert out.metrics(mask)["actor/ppo_kl"] == pytest.approx(-(d[0] + d[1]) / 2, rel=1e-12)  # verl: mean of -d
    with pytest.raises(ValueError, match="dro_beta > 0"):
        run("dro", *tokens([0.5], [0.9], [1.0]))


def test_dro_without_its_beta_is_refused_in_the_config():
    from geartrain.trainer.config import AlgorithmConfig

    with pytest.raises(ValueError, match="policy_loss 'dro' needs dro_beta"):
        AlgorithmConfig(policy_loss="dro")
    assert AlgorithmConfig(policy_loss="dro", dro_beta=0.1).dro_beta == 0.1
