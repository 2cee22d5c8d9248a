"""The optimal token baseline estimators (verl's ``optimal_token_baseline`` and
``tir_optimal_token_baseline``) against their formulas written out as plain loops over
verl-shaped inputs (response-only ``[B, L]`` tensors), hand-computed values, and their edge
cases: empty rows, zero tails, groups of one, importance weights, geartrain's layout."""

from __future__ import annotations

import math

import pytest
import torch
from geartrain.algorithms import AdvantageConfig, compute_advantages

F64 = torch.float64
SINGLE, MULTI = "optimal_token_baseline", "tir_optimal_token_baseline"


def reference(rewards, mask, ids, logp, spp, isw=None, *, multi_turn, zero_tail, eps=1e-8):
    """The OTB advantages by the formulas (B_t = sum_i G W / (sum_i W + eps)), one number at a
    time: step t is the response column (single-turn) or the t-th masked token (multi-turn)."""
    rows, width = mask.shape
    m = mask.tolist()
    ret = [[sum(rewards[r, j].item() * m[r][j] for j in range(t, width)) for t in range(width)] for r in range(rows)]
    w_cum = []
    for r in range(rows):
        acc, out = 0.0, []
        for j in range(width):
            w = 1 - 2 * math.exp(logp[r, j].item()) + spp[r, j].item()
            if isw is not None:
                w *= isw[r, j].item() ** 2
            acc += w * m[r][j]
            out.append(acc)
        w_cum.append(out)
    # each row's steps: (column of the step) for every step it has
    if multi_turn:
        steps = [[j for j in range(width) if m[r][j]] for r in range(rows)]
    else:
        steps = [list(range(width)) for _ in range(rows)]
    lengths = [int(sum(m[r])) for r in range(rows)]
    adv = [[0.0] * width for _ in range(rows)]
    for g in dict.fromkeys(ids):
        members = [r for r in range(rows) if ids[r] == g and (lengths[r] > 0 or not multi_turn)]
        base = {r: [0.0] * width for r in members}
        if len(members) > 1:
            for k in range(width):
                num = den = 0.0
                for r in members:
                    if k < len(steps[r]):
                        col = steps[r][k]
                        on = 1.0 if multi_turn else m[r][col]
                        num += ret[r][col] * w_cum[r][col] * on
                        den += w_cum[r][col] * on
                for r in members:
                    base[r][k] = num / (den + eps)
            if zero_tail:
                ls = sorted((lengths[r] for r in members), reverse=True)
                if ls[0] > ls[1]:
                    (longest,) = [r for r in members if lengths[r] == ls[0]]
                    base[longest][ls[1] :] = [0.0] * (width - ls[1])
        for r in members:
            for k, col in enumerate(steps[r]):
                if m[r][col]:
                    adv[r][col] = ret[r][col] - base[r][k]
    return torch.tensor(adv, dtype=F64)


def verl_shaped(seed, lengths, *, gaps=False):
    """Response-only inputs: random token rewards, old log-probs in (-3, 0), Σπ² in
    [π², 1] (it is at least the sampled token's π²), a mask of ``lengths`` (with holes of
    tool output when ``gaps``)."""
    g = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), max(max(lengths), 1) + (3 if gaps else 0)
    mask = torch.zeros(rows, width, dtype=F64)
    for r, n in enumerate(lengths):
        mask[r, :n] = 1
        if gaps and n > 3:
            mask[r, 2:4] = 0  # a tool's output inside the response
            mask[r, n : n + 2] = 1
    rewards = torch.randn(rows, width, generator=g, dtype=F64) * mask
    logp = -3 * torch.rand(rows, width, generator=g, dtype=F64)
    pi = logp.exp()
    spp = pi**2 + (1 - pi**2) * torch.rand(rows, width, generator=g, dtype=F64)
    isw = 0.5 + 1.5 * torch.rand(rows, width, generator=g, dtype=F64)
    return rewards, mask, logp, spp, isw


IDS = ["a", "a", "a", "b", "b", "c", "d", "d", "d", "d"]
LENGTHS = [5, 3, 7, 4, 4, 6, 2, 6, 6, 1]


@pytest.mark.parametrize("name", [SINGLE, MULTI])
@pytest.mark.parametrize("zero_tail", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("gaps", [False, True])
def test_otb_equals_its_formula_on_verl_shaped_inputs(name, zero_tail, weighted, gaps):
    rewards, mask, logp, spp, isw = verl_shaped(1, LENGTHS, gaps=gaps)
    isw = isw if weighted else None
    adv, ret = compute_advantages(
        name,
        rewards,
        mask,
        group_ids=IDS,
        old_log_probs=logp,
        sum_pi_squared=spp,
        is_weights=isw,
        config=AdvantageConfig(otb_handle_zero_tail=zero_tail),
    )
    want = reference(rewards, mask, IDS, logp, spp, isw, multi_turn=name == MULTI, zero_tail=zero_tail)
    torch.testing.assert_close(adv, want, atol=1e-12, rtol=1e-12)
    # returns: the return-to-go under the mask (verl's, read there), 0 elsewhere
    rtg = (rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask
    torch.testing.assert_close(ret, rtg)


def test_verl_defaults_zero_tail_off_single_turn_on_multi_turn():
    rewards, mask, logp, spp, _ = verl_shaped(2, [5, 3, 2])
    ids = [0, 0, 0]
    kw = dict(group_ids=ids, old_log_probs=logp, sum_pi_squared=spp)
    for name, default in ((SINGLE, False), (MULTI, True)):
        adv, _ = compute_advantages(name, rewards, mask, **kw)
        explicit, _ = compute_advantages(
            name, rewards, mask, config=AdvantageConfig(otb_handle_zero_tail=default), **kw
        )
        other, _ = compute_advantages(
            name, rewards, mask, config=AdvantageConfig(otb_handle_zero_tail=not default), **kw
        )
        assert torch.equal(adv, explicit)
        assert not torch.equal(adv, other)


def test_hand_computed_two_trajectories():
    # two responses of one prompt, outcome rewards 1 and 0.5 on their last tokens
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=F64)
    rewards = torch.tensor([[0, 1, 0], [0, 0, 0.5]], dtype=F64)
    pi = torch.tensor([[0.5, 0.5, 1.0], [0.25, 0.5, 0.5]], dtype=F64)
    spp = torch.tensor([[0.5, 0.5, 1.0], [0.5, 0.75, 0.5]], dtype=F64)
    # w = 1 - 2 pi + spp: row 0: 0.5, 0.5; row 1: 1.0, 0.75, 0.5 -> W: 0.5, 1.0 | 1.0, 1.75, 2.25
    # G: row 0: 1, 1; row 1: 0.5, 0.5, 0.5
    # B_0 = (1 * 0.5 + 0.5 * 1) / 1.5, B_1 = (1 * 1 + 0.5 * 1.75) / 2.75, B_2 = 0.5 * 2.25 / 2.25
    e = 1e-8
    b0, b1, b2 = 1.0 / (1.5 + e), 1.875 / (2.75 + e), 1.125 / (2.25 + e)
    kw = dict(group_ids=["p", "p"], old_log_probs=pi.log(), sum_pi_squared=spp)
    adv, _ = compute_advantages(SINGLE, rewards, mask, **kw)
    torch.testing.assert_close(adv, torch.tensor([[1 - b0, 1 - b1, 0], [0.5 - b0, 0.5 - b1, 0.5 - b2]], dtype=F64))
    # zero tail: row 1 is the only longest, its step 2 (past length 2) gets no baseline
    adv, _ = compute_advantages(SINGLE, rewards, mask, config=AdvantageConfig(otb_handle_zero_tail=True), **kw)
    torch.testing.assert_close(adv, torch.tensor([[1 - b0, 1 - b1, 0], [0.5 - b0, 0.5 - b1, 0.5]], dtype=F64))
    # importance weights rho scale w by rho^2: row 0 by 4 (W 2, 4)
    rho = torch.tensor([[2.0, 2.0, 1.0], [1.0, 1.0, 1.0]], dtype=F64)
    adv, _ = compute_advantages(SINGLE, rewards, mask, is_weights=rho, **kw)
    b0, b1 = 2.5 / (3.0 + e), 4.875 / (5.75 + e)
    torch.testing.assert_close(adv, torch.tensor([[1 - b0, 1 - b1, 0], [0.5 - b0, 0.5 - b1, 0.5 - b2]], dtype=F64))


@pytest.mark.parametrize("name", [SINGLE, MULTI])
def test_a_group_of_one_gets_no_baseline(name):
    rewards, mask, logp, spp, _ = verl_shaped(3, [4, 2])
    adv, ret = compute_advantages(name, rewards, mask, group_ids=["x", "y"], old_log_probs=logp, sum_pi_squared=spp)
    torch.testing.assert_close(adv, ret)  # A = G


def test_empty_rows_count_in_single_turn_groups_but_not_in_multi_turn_ones():
    # a prompt with one real response and one empty one (e.g. cut at 0 tokens)
    rewards, mask, logp, spp, _ = verl_shaped(4, [4, 0])
    kw = dict(group_ids=["p", "p"], old_log_probs=logp, sum_pi_squared=spp)
    single, ret = compute_advantages(SINGLE, rewards, mask, **kw)
    multi, _ = compute_advantages(MULTI, rewards, mask, **kw)
    # multi-turn: the empty row leaves the group, a group of one: A = G
    torch.testing.assert_close(multi, ret)
    # single-turn: a group of two, the baseline is the row's own G W / (W + eps): A ~ 0
    assert single.abs().max() < 1e-6 and ret.abs().max() > 0.1
    assert torch.equal(single[1], torch.zeros(mask.shape[1], dtype=F64))
    # the zero tail: the real row is strictly longer than the empty one, no baseline: A = G
    tail, _ = compute_advantages(SINGLE, rewards, mask, config=AdvantageConfig(otb_handle_zero_tail=True), **kw)
    torch.testing.assert_close(tail, ret)
    empty = torch.zeros_like(mask)
    adv, ret = compute_advantages(SINGLE, rewards * 0, empty, **kw)
    assert torch.equal(adv, empty) and torch.equal(ret, empty)


def test_zero_tail_needs_a_single_longest_row():
    rewards, mask, logp, spp, _ = verl_shaped(5, [5, 5, 2])
    kw = dict(group_ids=[0, 0, 0], old_log_probs=logp, sum_pi_squared=spp)
    on, _ = compute_advantages(SINGLE, rewards, mask, config=AdvantageConfig(otb_handle_zero_tail=True), **kw)
    off, _ = compute_advantages(SINGLE, rewards, mask, config=AdvantageConfig(otb_handle_zero_tail=False), **kw)
    assert torch.equal(on, off)  # two rows share the longest length: nothing is zeroed


@pytest.mark.parametrize("name", [SINGLE, MULTI])
def test_geartrain_layout_gives_the_response_only_result(name):
    """In a batch laid out as geartrain's (left-padded prompt in front, aligned to input_ids)
    the advantages under the mask are those of the response-only tensors."""
    rewards, mask, logp, spp, isw = verl_shaped(6, LENGTHS, gaps=True)
    prompt = 5

    def padded(x, fill=0.0):
        return torch.cat([torch.full((x.shape[0], prompt), fill, dtype=x.dtype), x], dim=1)

    kw = dict(group_ids=IDS, config=AdvantageConfig(otb_handle_zero_tail=True))
    adv, ret = compute_advantages(name, rewards, mask, old_log_probs=logp, sum_pi_squared=spp, is_weights=isw, **kw)
    wide, wide_ret = compute_advantages(
        name,
        padded(rewards, 7.0),  # junk outside the mask must not count
        padded(mask),
        old_log_probs=padded(logp, -0.1),
        sum_pi_squared=padded(spp, 0.9),
        is_weights=padded(isw, 3.0),
        **kw,
    )
    torch.testing.assert_close(wide[:, prompt:], adv, atol=1e-12, rtol=0)
    torch.testing.assert_close(wide_ret[:, prompt:], ret, atol=1e-12, rtol=0)
    assert torch.equal(wide[:, :prompt], torch.zeros(len(IDS), prompt, dtype=F64))


@pytest.mark.parametrize("name", [SINGLE, MULTI])
def test_missing_inputs_are_named(name):
    rewards, mask, logp, spp, _ = verl_shaped(7, [2, 2])
    with pytest.raises(ValueError, match="needs sum_pi_squared"):
        compute_advantages(name, rewards, mask, group_ids=[0, 0], old_log_probs=logp)
    with pytest.raises(ValueError, match="needs old_log_probs"):
        compute_advantages(name, rewards, mask, group_ids=[0, 0], sum_pi_squared=spp)
    with pytest.raises(ValueError, match="needs group_ids"):
        compute_advantages(name, rewards, mask, old_log_probs=logp, sum_pi_squared=spp)


def test_check_refuses_otb_on_an_engine_without_sum_pi_squared(tmp_path, capsys):
    """The fake engine does not declare ``sum_pi_squared``: ``geartrain check`` names the key
    and the capability in one line (exit 2) before anything is built."""
    from geartrain.cli import main
    from geartrain.testing.fakes import FakeBackends

    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "ground_truth": "2"}\n' * 4)
    job = tmp_path / "job.toml"
    job.write_text(
        '[model]\ntiny = "qwen2"\n[reward]\nfunction = "arithmetic"\n[actor.engine]\nbackend = "fake"\n'
        '[rollout]\nbackend = "fake"\n[data]\npath = "train.jsonl"\nbatch_size = 2\napply_chat_template = false\n'
        f'[trainer]\noutput_dir = "{tmp_path / "run"}"\n'
    )
    with FakeBackends().registered() as fakes:
        assert main(["check", str(job)]) == 0
        capsys.readouterr()
        for name in (SINGLE, MULTI):
            assert main(["check", str(job), f"algorithm.advantage={name}"]) == 2
            err = capsys.readouterr().err
            assert "algorithm.advantage: needs the 'fake' engine (actor.engine) to declare 'sum_pi_squared'" in err
            assert "Traceback" not in err
        assert not [c for c in fakes.calls if c.hook == "build_model"]


def _trainer_advantages(overrides, batch):
    """``RLTrainer.advantages`` (the trainer's own code) on ``batch`` under a job config with
    ``overrides``; no roles are needed for it."""
    from geartrain.trainer import load_train_config
    from geartrain.trainer.log_probs import needs_sum_pi_squared
    from geartrain.trainer.rl import RLTrainer

    trainer = object.__new__(RLTrainer)
    trainer.config = load_train_config(None, overrides, check_plugins=False)
    trainer.kl_ctrl = None
    trainer.needs_baselines = trainer.needs_components = False
    trainer.needs_sum_pi_squared = needs_sum_pi_squared(trainer.config)
    trainer.advantages(batch)
    return batch["advantages"]


def _step_batch():
    from geartrain.batch import Batch

    rewards, mask, logp, spp, _ = verl_shaped(8, [5, 3, 7, 4, 4, 6], gaps=True)
    rollout = logp + 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    tensors = {"response_mask": mask, "old_log_probs": logp, "rollout_log_probs": rollout, "sum_pi_squared": spp}
    scores = [1.0, 0.0, 2.0, 0.5, 0.5, 3.0]
    return Batch(tensors, meta={"score": scores, "uid": ["a", "a", "a", "b", "b", "c"]}), mask


@pytest.mark.parametrize("name", [SINGLE, MULTI])
@pytest.mark.parametrize("correction", [None, "truncate", "mask"])
def test_the_trainer_feeds_otb_the_loss_importance_weights(name, correction):
    """The trainer's advantages: the estimator on the batch's old log-probs and Σπ², with the
    rollout IS weights the actor's loss applies when ``tis_cap`` is set (verl's
    rollout_is_weights)."""
    from geartrain.algorithms import masked_is_weights, truncated_is_weights
    from geartrain.rewards import token_level_scores

    batch, mask = _step_batch()
    overrides = [f"algorithm.advantage={name}"]
    weights = None
    if correction is not None:
        overrides += ["algorithm.tis_cap=1.2", f"algorithm.off_policy_correction={correction}"]
        old, rollout = batch["old_log_probs"], batch["rollout_log_probs"]
        weights = (
            truncated_is_weights(old, rollout, mask, cap=1.2)
            if correction == "truncate"
            else masked_is_weights(old, rollout, mask, low=0.5, high=1.2)
        )
    got = _trainer_advantages(overrides, batch)
    rewards = token_level_scores(torch.tensor(batch["score"], dtype=torch.float32), mask)
    want, _ = compute_advantages(
        name,
        rewards,
        mask,
        group_ids=batch["uid"],
        old_log_probs=batch["old_log_probs"],
        sum_pi_squared=batch["sum_pi_squared"],
        is_weights=weights,
    )
    torch.testing.assert_close(got, want.to(got.dtype), atol=1e-6, rtol=0)
    if correction is not None:  # the weights matter here: without them the result differs
        plain, _ = compute_advantages(
            name,
            rewards,
            mask,
            group_ids=batch["uid"],
            old_log_probs=batch["old_log_probs"],
            sum_pi_squared=batch["sum_pi_squared"],
        )
        assert (got - plain.to(got.dtype)).abs().max() > 1e-3


def test_the_trainer_divides_gpg_by_the_configured_f_norm():
    batch, mask = _step_batch()
    one = _trainer_advantages(["algorithm.advantage=gpg"], batch)
    four = _trainer_advantages(["algorithm.advantage=gpg", "algorithm.gpg_f_norm=4"], batch)
    assert one.abs().max() > 0.1
    torch.testing.assert_close(four, one / 4)
