"""Every registered advantage estimator and policy loss runs through ``RLTrainer.step`` (the
real FSDP engine on one rank, the torch rollout, the arithmetic task's data and reward) for
20 steps with finite losses, so no registry entry is a dead end. Kept cheap: the main
job's tiny model, 4 prompts x 4 samples of at most 5 tokens, no SFT, no validation."""

from __future__ import annotations

import math

import pytest
import torch
from e2e_helpers import MAIN_CONFIG
from geartrain.algorithms import ADVANTAGES, POLICY_LOSSES
from geartrain.trainer.config import load_train_config
from geartrain.trainer.preflight import preflight
from geartrain.trainer.rl import RLTrainer
from geartrain.trainer.run import Job

pytestmark = pytest.mark.e2e

STEPS = 20
CHEAP = [
    "sft.enabled=false",
    "validation.path=null",
    "data.batch_size=4",
    "sampling.n=4",
    "trainer.torch_threads=1",
    "actor.engine.optim.lr=1e-4",
    "actor.engine.optim.warmup_steps=0",
    "actor.engine.optim.lr_schedule=constant",
]

# (name, overrides): every estimator with the PPO clip loss, every loss with GRPO
CASES = [
    (f"advantage={a}", [f"algorithm.advantage={a}"] + (["algorithm.name=ppo"] if a == "gae" else []))
    for a in ADVANTAGES.names()
]
CASES += [
    (f"policy_loss={p}", [f"algorithm.policy_loss={p}"] + (["algorithm.dro_beta=0.1"] if p == "dro" else []))
    for p in POLICY_LOSSES.names()
    if p != "ppo"
]
CASES += [
    (
        "dapo",
        [
            "algorithm.dynamic_sampling=true",
            "algorithm.overlong_buffer=2",
            "algorithm.clip_ratio_high=0.28",
            "algorithm.loss_agg_mode=token-mean",
        ],
    ),
    ("kl_loss=k3+", ["algorithm.use_kl_loss=true", "algorithm.kl_loss_kind=k3+", "algorithm.kl_loss_coef=0.01"]),
    ("token-sum", ["algorithm.loss_agg_mode=token-sum", "actor.engine.optim.lr=1e-6"]),
]


def text_hash_reward(response: str, ground_truth: str) -> float:
    """A reward that varies with the text, so an untrained model's greedy response gets a
    non-zero baseline (exact match would score it 0 and hide whether it was subtracted)."""
    return (sum(map(ord, response)) % 7) / 7


def make_trainer(overrides: list[str], tmp_path, reward_fn=None) -> tuple[RLTrainer, Job]:
    config = load_train_config(str(MAIN_CONFIG), [*CHEAP, *overrides, f"trainer.output_dir={tmp_path}"])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    job = Job(config)
    pre = preflight(config, reward_fn=reward_fn)  # reads the data and resolves the reward, as a job does
    job.reward_fn = pre.reward
    loader, _ = job._data(pre)
    roles = job.build_roles(config.model)
    return RLTrainer(config, roles, pre.tokenizer, loader), job


def shutdown(trainer: RLTrainer) -> None:
    for group in (trainer.roles.actor, trainer.roles.reference, trainer.roles.critic, trainer.roles.reward):
        if group is not None:
            group.shutdown()


@pytest.mark.parametrize(("name", "overrides"), CASES, ids=[c[0] for c in CASES])
def test_every_algorithm_trains_20_steps_with_finite_losses(name: str, overrides: list[str], tmp_path) -> None:
    trainer, _ = make_trainer(overrides, tmp_path, reward_fn=text_hash_reward if name == "advantage=remax" else None)
    updates = []  # the batches the actor was updated on
    call = trainer.roles.actor.call

    def spy(method, *args, **kwargs):
        if method in ("update", "update_once"):  # update_once: one optimizer step, log-probs reused
            updates.append(args[0])
        return call(method, *args, **kwargs)

    trainer.roles.actor.call = spy
    try:
        records = [trainer.step(step) for step in range(1, STEPS + 1)]
    finally:
        shutdown(trainer)
    assert len(updates) == STEPS
    losses = [r["actor/pg_loss"] for r in records if "actor/pg_loss" in r]
    assert len(losses) == STEPS, f"the actor updated in {len(losses)} of {STEPS} steps"
    assert all(math.isfinite(v) for v in losses), losses
    assert all(math.isfinite(r["actor/grad_norm"]) for r in records)
    if name == "advantage=gae":
        assert all(math.isfinite(r["critic/vf_loss"]) for r in records)
    if name == "advantage=remax":
        # the greedy response's reward was generated, scored and subtracted on every token
        assert all("reward/greedy_baseline_mean" in r for r in records)
        for batch in updates:
            mask = batch["loss_mask"].bool()
            for row, (score, base) in enumerate(zip(batch["score"], batch["reward_baseline"], strict=True)):
                assert torch.allclose(batch["advantages"][row][mask[row]], torch.tensor(score - base)), row
        # a non-zero baseline, so A = s - b differs from the raw score
        assert any(any(v != 0 for v in b["reward_baseline"]) for b in updates)
    if name == "dapo":
        for r in records:
            kept, short = r["dynamic_sampling/kept_groups"], r["dynamic_sampling/short"]
            assert kept == 4 or short == 1.0, r
            assert r["dynamic_sampling/extra_rounds"] <= 4
            assert r["reward/overlong_penalty_mean"] <= 0.0
        assert sum(r["dynamic_sampling/dropped_groups"] for r in records) > 0
        for batch, r in zip(updates, records, strict=True):
            if not r["dynamic_sampling/short"]:
                groups: dict[str, set[float]] = {}
                for uid, score in zip(batch["uid"], batch["score"], strict=True):
                    groups.setdefault(uid, set()).add(score)
                assert len(groups) == 4 and all(len(v) > 1 for v in groups.values())
