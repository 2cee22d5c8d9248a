"""Policy losses, value loss, entropy bonus and loss aggregation, pinned to hand values."""

from __future__ import annotations

import math

import pytest
import torch
from geartrain.algorithms import (
    PolicyLossConfig,
    aggregate,
    entropy_bonus,
    get_policy_loss,
    register_policy_loss,
    value_loss,
)
from geartrain.algorithms.policy_losses import POLICY_LOSSES
from geartrain.types import LossContext

CLIP_HIGHER = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


def ppo_case():
    """Row 0: A = +1 with ratios 1.1 (inside), 1.5 (above 1 + 0.28), 0.5 (below 1 - 0.2);
    row 1: A = -1 with ratios 0.5 (clipped), 5 (dual-clipped at 3), 2 (plain);
    column 3 is padding holding junk (inf) that must not leak."""
    ratios = torch.tensor([[1.1, 1.5, 0.5, 1.0], [0.5, 5.0, 2.0, 1.0]], dtype=torch.float64)
    old = torch.tensor([[-1.0, -2.0, -0.5, -math.inf], [-1.5, -0.1, -3.0, -math.inf]], dtype=torch.float64)
    logp = (old + ratios.log()).clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.float64)
    return logp, old, adv, mask


def test_ppo_clip_higher_and_dual_clip_values_and_gradients():
    logp, old, adv, mask = ppo_case()
    out = get_policy_loss("ppo")(logp, old, adv, mask, config=CLIP_HIGHER)
    expected = [[-1.1, -1.28, -0.5, 0.0], [0.8, 3.0, 2.0, 0.0]]
    assert out.loss_mat.tolist()[0] == pytest.approx(expected[0])
    assert out.loss_mat.tolist()[1] == pytest.approx(expected[1])
    out.loss_mat.sum().backward()
    # d(-A r)/d logp = -A r where the unclipped term is active; 0 where clipped or dual-clipped
    assert logp.grad.tolist()[0] == pytest.approx([-1.1, 0.0, -0.5, 0.0])
    assert logp.grad.tolist()[1] == pytest.approx([0.0, 0.0, 2.0, 0.0])
    assert out.token_stats["clipped"].tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]
    assert out.token_stats["clipped_lower"].tolist() == [[0, 0, 0, 0], [0, 1, 0, 0]]
    metrics = out.metrics(mask)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 6)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 6)
    log_r = [math.log(r) for r in (1.1, 1.5, 0.5, 0.5, 5.0, 2.0)]
    assert metrics["actor/ppo_kl"] == pytest.approx(-sum(log_r) / 6)
    # as a share of a step with 12 tokens
    assert out.metrics(mask, global_tokens=12)["actor/pg_clipfrac"] == pytest.approx(2 / 12)


def test_ppo_asymmetric_vs_symmetric_clip_and_dual_clip_off():
    old = torch.zeros(1, 4, dtype=torch.float64)
    logp = torch.tensor([[1.25, 0.75, 0.75, 5.0]], dtype=torch.float64).log()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    asym = get_policy_loss("ppo")(logp, old, adv, mask, config=CLIP_HIGHER).loss_mat
    # 1.25 < 1.28: not clipped; 0.75 < 0.8 with A > 0: unclipped wins; with A < 0: clipped to 0.8; 5 -> 3
    assert asym.tolist()[0] == pytest.approx([-1.25, -0.75, 0.8, 3.0])
    sym = get_policy_loss("ppo")(logp, old, adv, mask, config=PolicyLossConfig(clip_ratio=0.2, clip_ratio_c=None))
    assert sym.loss_mat.tolist()[0] == pytest.approx([-1.2, -0.75, 0.8, 5.0])
    with pytest.raises(ValueError, match="clip_ratio_c"):
        get_policy_loss("ppo")(logp, old, adv, mask, config=PolicyLossConfig(clip_ratio_c=0.5))


def test_ppo_importance_weights_scale_the_loss():
    logp, old, adv, mask = ppo_case()
    w = torch.full_like(adv, 0.5)
    plain = get_policy_loss("ppo")(logp, old, adv, mask, config=CLIP_HIGHER).loss_mat
    weighted = get_policy_loss("ppo")(logp, old, adv, mask, config=CLIP_HIGHER, is_weights=w).loss_mat
    assert torch.allclose(weighted, 0.5 * plain)


def test_gspo_sequence_ratio_token_gradient_and_clamp():
    old = torch.zeros(3, 3, dtype=torch.float64)
    delta = torch.tensor([[0.2, -0.1, 7.0], [0.5, 0.5, 0.5], [12.0, 12.0, 12.0]], dtype=torch.float64)
    logp = (old + delta).requires_grad_(True)
    adv = torch.tensor([[1.0] * 3, [1.0] * 3, [-1.0] * 3], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.float64)
    out = get_policy_loss("gspo")(logp, old, adv, mask, config=CLIP_HIGHER)
    s0 = math.exp(0.05)  # row 0: masked mean of (0.2, -0.1); the 7.0 is padding
    e10 = math.exp(10.0)  # row 2: log-ratio 12 clamped at 10; A < 0 and no dual-clip
    assert out.loss_mat.tolist()[0] == pytest.approx([-s0, -s0, 0.0])
    assert out.loss_mat.tolist()[1] == pytest.approx([-1.28] * 3)  # exp(0.5) = 1.65 clipped at 1.28
    assert out.loss_mat.tolist()[2] == pytest.approx([e10] * 3)
    out.loss_mat.sum().backward()
    # per-token gradient of s_i * logp_t: -A * s_i (unclipped), 0 when clipped or clamped
    assert logp.grad.tolist()[0] == pytest.approx([-s0, -s0, 0.0])
    assert logp.grad.tolist()[1] == [0.0, 0.0, 0.0]
    assert logp.grad.tolist()[2] == [0.0, 0.0, 0.0]
    assert out.token_stats["clipped"].tolist() == [[0, 0, 0], [1, 1, 1], [0, 0, 0]]


def test_value_loss_clipping():
    values = torch.tensor([[1.0, 2.0, 2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.8, 1.0, 1.0, 0.0]])
    returns = torch.tensor([[1.5, 1.0, 3.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, stats = value_loss(values, old, returns, mask, clip_range=0.5)
    # t0 inside the clip; t1 clipped value 1.5 is closer to 1.0 (max takes the unclipped 1.0);
    # t2 clipped value 1.5 is farther from 3.0: (1.5 - 3)^2 = 2.25 wins; t3 masked
    assert loss.tolist()[0] == pytest.approx([0.125, 0.5, 1.125, 0.0])
    assert stats["clipped"].tolist() == [[0, 0, 1, 0]]
    loss.sum().backward()
    assert values.grad.tolist()[0] == pytest.approx([-0.5, 1.0, 0.0, 0.0])
    plain, _ = value_loss(values, old, returns, mask, clip_range=None)
    assert plain.tolist()[0] == pytest.approx([0.125, 0.5, 0.5, 0.0])


def test_entropy_bonus():
    ent = torch.tensor([[2.0, 1.0, 9.0]])
    assert entropy_bonus(ent, torch.tensor([[1, 1, 0]]), 0.01).tolist()[0] == pytest.approx([-0.02, -0.01, 0.0])


# ------------------------------------------------------------------ aggregation
LOSS = torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
AGG_MASK = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1], [0, 0, 0, 1]])


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        ("token-mean", {}, (3 + 21 + 12) / 6),
        ("seq-mean-token-sum", {}, (3 + 21 + 12) / 3),
        ("seq-mean-token-mean", {}, (1.5 + 7 + 12) / 3),
        ("seq-mean-token-sum-norm", {}, (3 + 21 + 12) / 4 / 3),
        ("seq-mean-token-sum-norm", {"norm_length": 8}, (3 + 21 + 12) / 8 / 3),
        ("token-mean", {"global_tokens": 12}, 36 / 12),
        ("seq-mean-token-sum", {"global_sequences": 6}, 36 / 6),
    ],
)
def test_aggregate_modes_by_hand(mode, kwargs, expected):
    assert aggregate(LOSS, AGG_MASK, mode, **kwargs).item() == pytest.approx(expected)


def test_aggregate_ignores_non_finite_masked_entries_and_empty_batches():
    loss = LOSS.clone()
    loss[0, 3] = math.inf
    loss[1, 0] = math.nan
    assert aggregate(loss, AGG_MASK, "token-mean").item() == pytest.approx(6.0)
    empty = torch.zeros(2, 3, dtype=torch.long)
    for mode in ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert aggregate(torch.ones(2, 3), empty, mode).item() == 0.0
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        aggregate(LOSS, AGG_MASK, "token-summ")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_shares_over_micro_batches_and_ranks_sum_to_the_unsplit_loss(mode):
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(10, 7, generator=gen, dtype=torch.float64).requires_grad_(True)
    lengths = [7, 1, 3, 0, 5, 2, 6, 4, 1, 7]  # ragged; one empty row
    mask = torch.tensor([[1] * n + [0] * (7 - n) for n in lengths])
    full = aggregate(loss, mask, mode, norm_length=7)
    (full_grad,) = torch.autograd.grad(full, loss)
    # 2 ranks x uneven micro-batches: rows [0:3], [3:4] on rank 0; [4:9], [9:10] on rank 1
    ctx = LossContext(global_tokens=int(mask.sum()), global_sequences=10, dp_size=2)
    total = torch.zeros((), dtype=torch.float64)
    for start, stop in [(0, 3), (3, 4), (4, 9), (9, 10)]:
        total = total + aggregate(
            loss[start:stop],
            mask[start:stop],
            mode,
            global_tokens=ctx.global_tokens,
            global_sequences=ctx.global_sequences,
            norm_length=7,
        )
    (split_grad,) = torch.autograd.grad(total, loss)
    assert total.item() == pytest.approx(full.item(), rel=1e-12)
    assert torch.allclose(split_grad, full_grad, rtol=1e-12)


def test_policy_loss_registry():
    @register_policy_loss("test_reinforce")
    def reinforce(log_probs, old_log_probs, advantages, mask, *, config, is_weights=None):
        from geartrain.algorithms import PolicyLossOutput

        return PolicyLossOutput(loss_mat=-advantages * log_probs * mask)

    try:
        out = get_policy_loss("test_reinforce")(
            torch.tensor([[-1.0]]), torch.tensor([[-1.0]]), torch.tensor([[2.0]]), torch.ones(1, 1), config=None
        )
        assert out.loss_mat.item() == 2.0
    finally:
        POLICY_LOSSES._entries.pop("test_reinforce")
    with pytest.raises(KeyError, match="gspo, kl_cov, ppo"):
        get_policy_loss("vanilla2")


# ------------------------------------------------------------------ ready-made LossFns
def _tiny_log_probs(model, input_ids, attention_mask):
    """log p(x_t | x_<t) aligned to input_ids (position 0 holds 0), straight from HF."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_actor_loss_fn_on_a_tiny_model_is_split_invariant(mode):
    from geartrain import Batch
    from geartrain.algorithms import ActorLossConfig, make_actor_loss
    from geartrain.testing import tiny_model

    model = tiny_model("qwen2", seed=0).float()
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(4, 100, (4, 9), generator=gen)
    attention = torch.ones_like(input_ids)
    loss_mask = torch.zeros_like(input_ids)
    for row, n in enumerate([5, 2, 4, 3]):
        loss_mask[row, 4 : 4 + n] = 1
    with torch.no_grad():
        old = _tiny_log_probs(model, input_ids, attention) + 0.05 * torch.randn(4, 9, generator=gen)
    batch = Batch(
        {
            "input_ids": input_ids,
            "attention_mask": attention,
            "loss_mask": loss_mask,
            "old_log_probs": old,
            "advantages": torch.randn(4, 9, generator=gen),
            "ref_log_probs": old - 0.1,
        }
    )
    cfg = ActorLossConfig(loss_agg_mode=mode, kl_loss_coef=0.01, clip=CLIP_HIGHER)
    loss_fn = make_actor_loss(cfg)

    def run(pieces):
        model.zero_grad()
        ctx = LossContext(global_tokens=int(loss_mask.sum()), global_sequences=4)
        total, metrics = 0.0, {}
        for piece in pieces:
            lp = _tiny_log_probs(model, piece["input_ids"], piece["attention_mask"])
            loss, m = loss_fn({"log_probs": lp}, piece, ctx)
            loss.backward()
            total += loss.item()
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return total, metrics, grads

    whole, whole_metrics, whole_grad = run([batch])
    split, split_metrics, split_grad = run(batch.split_by_sizes([1, 2, 1]))
    assert split == pytest.approx(whole, rel=1e-5)
    assert split_metrics == pytest.approx(whole_metrics, rel=1e-5, abs=1e-7)
    assert torch.allclose(split_grad, whole_grad, rtol=1e-4, atol=1e-7)
    assert whole_metrics["actor/pg_loss"] + 0.01 * whole_metrics["actor/kl_loss"] == pytest.approx(whole, rel=1e-6)
    # old log-probs differ from the current ones by ~0.05 noise: ppo_kl is the token-mean of old - new
    lp = _tiny_log_probs(model, input_ids, attention).detach()
    expected_kl = ((old - lp) * loss_mask).sum() / loss_mask.sum()
    assert whole_metrics["actor/ppo_kl"] == pytest.approx(float(expected_kl), rel=1e-4)


def test_critic_loss_fn():
    from geartrain import Batch
    from geartrain.algorithms import CriticLossConfig, make_critic_loss

    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0]])
    batch = Batch(
        {
            "loss_mask": mask,
            "old_values": torch.tensor([[0.0, 0.8, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]]),
            "returns": torch.tensor([[0.0, 1.5, 1.0, 3.0], [0.0, 0.0, 2.0, 0.0]]),
        }
    )
    values = torch.tensor([[0.0, 1.0, 2.0, 2.0], [0.0, 0.0, 1.0, 0.0]])
    loss, metrics = make_critic_loss(CriticLossConfig(clip_range=0.5))(
        {"values": values}, batch, LossContext(global_tokens=4, global_sequences=2)
    )
    # per token: 0.125, 0.5, 1.125 (clipped), 0.5 -> token-mean over 4 tokens
    assert loss.item() == pytest.approx((0.125 + 0.5 + 1.125 + 0.5) / 4)
    assert metrics == pytest.approx({"critic/vf_loss": 2.25 / 4, "critic/vf_clipfrac": 0.25})
