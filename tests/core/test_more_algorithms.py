"""The estimators GRPO pass@k, OPO and GPG, ``token-sum`` aggregation, the straight-through
KL estimators, the biased-variance whitening option and DAPO's overlong penalty and group
filter, pinned to values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from geartrain.algorithms import AdvantageConfig, aggregate, compute_advantages, kl_estimate, masked_whiten
from geartrain.algorithms.dapo import informative_groups, overlong_penalty

F64 = torch.float64


def outcome(scores, lengths, width=4):
    """Token rewards with each row's score on its last response token, a ragged mask."""
    rewards = torch.zeros(len(scores), width, dtype=F64)
    mask = torch.zeros(len(scores), width, dtype=F64)
    for row, (score, n) in enumerate(zip(scores, lengths, strict=True)):
        mask[row, :n] = 1
        rewards[row, n - 1] = score
    return rewards, mask


def per_row(adv, mask):
    """The advantage of each row (constant over its mask), checking it is 0 outside."""
    assert bool((adv[mask == 0] == 0).all())
    return [float(adv[r][mask[r].bool()][0]) for r in range(adv.shape[0])]


def test_grpo_passk_rewards_only_the_best_sample_by_the_gap_to_the_second():
    rewards, mask = outcome([1.0, 0.0, 3.0, 2.0, 2.0], [2, 1, 3, 4, 2])
    ids = ["a", "a", "a", "b", "b"]
    adv, ret = compute_advantages("grpo_passk", rewards, mask, group_ids=ids)
    # group a: (3 - 1) / (std([1, 0, 3]) = sqrt(7/3) + 1e-6) on the best row only; group b ties: 0
    assert per_row(adv, mask) == pytest.approx([0.0, 0.0, 2 / (math.sqrt(7 / 3) + 1e-6), 0.0, 0.0])
    assert torch.equal(adv, ret)
    adv, _ = compute_advantages("grpo_passk", rewards, mask, group_ids=ids, config=AdvantageConfig(norm_by_std=False))
    assert per_row(adv, mask) == pytest.approx([0.0, 0.0, 2.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="group 'c' has 1"):
        compute_advantages("grpo_passk", rewards[:1], mask[:1], group_ids=["c"])


def test_opo_subtracts_the_length_weighted_group_mean():
    rewards, mask = outcome([1.0, 0.0, 3.0, 5.0], [2, 1, 3, 2])
    adv, _ = compute_advantages("opo", rewards, mask, group_ids=[0, 0, 0, 1])
    # b = (2*1 + 1*0 + 3*3) / (2 + 1 + 3) = 11/6 (the plain mean would be 4/3); a group of one: b = 0
    assert per_row(adv, mask) == pytest.approx([1 - 11 / 6, -11 / 6, 3 - 11 / 6, 5.0])


def test_gpg_scales_the_centred_score_by_batch_over_nonzero_count():
    rewards, mask = outcome([1.0, 0.0, 3.0, 2.0, 2.0, 4.0], [2, 1, 3, 4, 2, 1])
    adv, _ = compute_advantages("gpg", rewards, mask, group_ids=["a", "a", "a", "b", "b", "c"])
    # alpha = 6 samples / 5 non-zero scores = 1.2; means 4/3, 2, and 0 for the singleton
    assert per_row(adv, mask) == pytest.approx([-0.4, -1.6, 2.0, 0.0, 0.0, 4.8])


def test_gpg_divides_by_f_norm():
    rewards, mask = outcome([1.0, 0.0, 3.0, 2.0, 2.0, 4.0], [2, 1, 3, 4, 2, 1])
    groups = ["a", "a", "a", "b", "b", "c"]
    adv, _ = compute_advantages("gpg", rewards, mask, group_ids=groups, config=AdvantageConfig(gpg_f_norm=4.0))
    # verl: alpha * (score - group mean) / f_norm: the f_norm = 1 values above, over 4
    assert per_row(adv, mask) == pytest.approx([-0.1, -0.4, 0.5, 0.0, 0.0, 1.2])


def test_token_sum_aggregation_is_the_unnormalised_masked_sum():
    loss = torch.tensor([[1.0, 2.0, math.inf], [3.0, 0.5, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert float(aggregate(loss, mask, "token-sum")) == 6.0
    # global counts do not rescale it: the shares of the micro-batches add up to the sum
    assert float(aggregate(loss, mask, "token-sum", global_tokens=30, global_sequences=7)) == 6.0


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        ("k1+", [0.5, -1.0]),  # k1's value: d
        ("k3+", [math.exp(-0.5) - 0.5, math.e - 2.0]),  # k3's value: exp(-d) - 1 + d
        ("low_var_kl+", [math.exp(-0.5) - 0.5, math.e - 2.0]),
        ("k2+", [0.125, 0.5]),  # k2 itself: d^2 / 2
        ("abs+", [0.5, 1.0]),  # abs's value: |d|
    ],
)
def test_straight_through_kl_has_one_estimators_value_and_k2s_gradient(kind, value):
    ref = torch.zeros(2, dtype=F64)
    logp = torch.tensor([0.5, -1.0], dtype=F64, requires_grad=True)
    kl = kl_estimate(logp, ref, kind)
    assert kl.tolist() == pytest.approx(value)
    kl.sum().backward()
    # k2's gradient d(d^2/2)/d logp = d, not k1's 1 nor k3's 1 - exp(-d) = [0.393, -1.718]
    assert logp.grad.tolist() == pytest.approx([0.5, -1.0])


def test_unknown_straight_through_kind_is_named():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4\\+'.*abs\\+"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4+")


def test_whitening_with_the_biased_variance():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]])
    # mean 2; unbiased var 2/2 = 1, biased var 2/3
    assert masked_whiten(values, mask)[0, :3].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-7)
    biased = masked_whiten(values, mask, unbiased=False)[0, :3].tolist()
    assert biased == pytest.approx([-math.sqrt(1.5), 0.0, math.sqrt(1.5)], abs=1e-7)
    # REINFORCE++ whitens its returns with it when asked
    rewards, rmask = outcome([1.0, 2.0, 3.0], [1, 1, 1], width=1)
    adv, _ = compute_advantages("reinforce_plus_plus", rewards, rmask, config=AdvantageConfig(unbiased_var=False))
    assert adv[:, 0].tolist() == pytest.approx([-math.sqrt(1.5), 0.0, math.sqrt(1.5)], abs=1e-7)


def test_overlong_penalty_is_zero_then_linear_over_the_buffer():
    lengths = torch.tensor([5, 6, 8, 10])
    # max 10, buffer 4: free up to 6 tokens, then -(L - 6) / 4 * factor
    assert overlong_penalty(lengths, max_length=10, buffer=4).tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0])
    assert overlong_penalty(lengths, max_length=10, buffer=4, factor=0.5).tolist() == pytest.approx(
        [0.0, 0.0, -0.25, -0.5]
    )
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, max_length=10, buffer=0)


def test_informative_groups_drop_all_equal_groups_and_singletons():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.5])
    keep, dropped = informative_groups(scores, ["a", "a", "b", "b", "c", "c", "d"])
    assert keep == [0, 1]
    assert dropped == ["b", "c", "d"]


def test_docs_table_lists_every_registered_algorithm():
    from pathlib import Path

    from geartrain.algorithms import ADVANTAGES, AGG_MODES, POLICY_LOSSES

    doc = (Path(__file__).resolve().parents[2] / "docs" / "algorithms.md").read_text()
    names = [
        *ADVANTAGES.names(),
        *POLICY_LOSSES.names(),
        *AGG_MODES,
        "k1",
        "k2",
        "k3",
        "abs",
        "k1+",
        "k2+",
        "k3+",
        "abs+",
    ]
    missing = [name for name in names if f"| `{name}`" not in doc]
    assert not missing, f"docs/algorithms.md has no row for {missing}"


def _whiten_by_hand(per_row: list[float], lengths: list[int]) -> list[float]:
    """Token-weighted mean and unbiased variance over the response tokens (verl's masked_whiten)."""
    tokens = [v for v, n in zip(per_row, lengths, strict=True) for _ in range(n)]
    mean = sum(tokens) / len(tokens)
    var = sum((t - mean) ** 2 for t in tokens) / (len(tokens) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in per_row]


def test_gdpo_normalises_each_reward_component_in_its_group_then_whitens_the_weighted_sum():
    lengths = [1, 2, 1, 2]
    rewards, mask = outcome([0.0] * 4, lengths)  # the components carry the reward
    components = torch.tensor([[1.0, 0.0], [0.0, 10.0], [1.0, 4.0], [1.0, 0.0]], dtype=F64)
    groups = ["a", "a", "b", "b"]
    adv, returns = compute_advantages(
        "gdpo", rewards, mask, group_ids=groups, components=components, config=AdvantageConfig(gdpo_weights=(1.0, 2.0))
    )
    eps = 1e-6
    # component 1: group a (1, 0): mean 0.5, unbiased std sqrt(0.5); group b (1, 1): all equal -> 0
    c1 = [0.5 / (math.sqrt(0.5) + eps), -0.5 / (math.sqrt(0.5) + eps), 0.0, 0.0]
    # component 2: group a (0, 10): mean 5, std sqrt(50); group b (4, 0): mean 2, std sqrt(8)
    c2 = [-5 / (math.sqrt(50) + eps), 5 / (math.sqrt(50) + eps), 2 / (math.sqrt(8) + eps), -2 / (math.sqrt(8) + eps)]
    total = [x + 2.0 * y for x, y in zip(c1, c2, strict=True)]
    assert per_row(adv, mask) == pytest.approx(_whiten_by_hand(total, lengths), rel=1e-9)
    assert torch.equal(adv, returns) and float(adv[mask == 0].abs().sum()) == 0.0
    # one component, the score itself: GRPO's advantage, whitened over the tokens
    scores, _ = outcome([1.0, 0.0, 1.0, 3.0], lengths)
    single, _ = compute_advantages("gdpo", scores, mask, group_ids=groups)
    grpo_adv = [
        0.5 / (math.sqrt(0.5) + eps),
        -0.5 / (math.sqrt(0.5) + eps),
        -1 / (math.sqrt(2) + eps),
        1 / (math.sqrt(2) + eps),
    ]
    assert per_row(single, mask) == pytest.approx(_whiten_by_hand(grpo_adv, lengths), rel=1e-9)
    with pytest.raises(ValueError, match="1 weights for 2 reward components"):
        compute_advantages(
            "gdpo", rewards, mask, group_ids=groups, components=components, config=AdvantageConfig(gdpo_weights=(1.0,))
        )


def test_gdpo_reads_the_reward_terms_the_config_names():
    from geartrain.batch import Batch
    from geartrain.errors import GeartrainError
    from geartrain.trainer.config import AlgorithmConfig
    from geartrain.trainer.rl import reward_components

    batch = Batch(meta={"reward_terms": [{"fmt": 1.0, "acc": 0.0}, {"fmt": 0.5, "acc": 1.0}]}, batch_size=2)
    assert reward_components(batch, ["acc", "fmt"]).tolist() == [[0.0, 1.0], [1.0, 0.5]]
    assert reward_components(batch, None).tolist() == [[1.0, 0.0], [0.5, 1.0]]  # every term, in order
    with pytest.raises(GeartrainError, match=r"no score from reward term\(s\) \['len'\].*\['fmt', 'acc'\]"):
        reward_components(batch, ["len"])
    with pytest.raises(ValueError, match="gdpo_reward_weights needs gdpo_reward_keys, one weight per key"):
        AlgorithmConfig(advantage="gdpo", gdpo_reward_keys=["acc"], gdpo_reward_weights=[1.0, 2.0])


def test_the_adaptive_kl_controller_without_its_target_is_refused_in_the_config() -> None:
    """Issue 35, round 13: ``kl_controller = 'adaptive'`` without ``target_kl`` and
    ``kl_horizon`` (or with ``target_kl = 0``) passed ``check`` and failed the run's start in a
    traceback, leaving a run directory that needed --overwrite."""
    from geartrain.trainer.config import AlgorithmConfig

    with pytest.raises(ValueError, match="kl_controller 'adaptive' needs target_kl .* and kl_horizon"):
        AlgorithmConfig(use_kl_in_reward=True, kl_controller="adaptive")
    with pytest.raises(ValueError, match="target_kl"):
        AlgorithmConfig(use_kl_in_reward=True, kl_controller="adaptive", target_kl=0.0, kl_horizon=100)
    AlgorithmConfig(use_kl_in_reward=True, kl_controller="adaptive", target_kl=6.0, kl_horizon=10000)


def test_a_critic_warm_up_as_long_as_the_run_is_named_as_such() -> None:
    """Issue 35, round 14: PPO with ``critic_warmup_steps >= total_steps`` (the actor never
    trains) was refused as "actor.engine.optim.total_steps: None disagrees with the 0 optimizer
    steps ... leave it unset" about a setting the user had left unset."""
    from pathlib import Path

    from geartrain.errors import ConfigError
    from geartrain.trainer import load_train_config

    job = Path(__file__).resolve().parents[2] / "examples" / "arithmetic" / "ppo.toml"
    with pytest.raises(ConfigError) as info:
        load_train_config(job, ["trainer.total_steps=20", "algorithm.critic_warmup_steps=20"], check_plugins=False)
    assert "algorithm.critic_warmup_steps: 20 warm-up steps of the critic leave none of the 20 steps" in str(info.value)
    assert "optim.total_steps" not in str(info.value).split("\n")[1]
    load_train_config(job, ["trainer.total_steps=20", "algorithm.critic_warmup_steps=19"], check_plugins=False)
