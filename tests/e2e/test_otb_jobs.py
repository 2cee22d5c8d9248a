"""The optimal token baseline recipes: the arithmetic main job (``examples/arithmetic/otb.toml``,
single-turn) and the agentic calculator job (``examples/calculator/tir_otb.toml``, the
multi-turn form) train through ``RLTrainer.step`` with the real FSDP engine and torch
rollout for a few steps, and each step's advantages are the estimator's on the old policy's
log-probs and the engine's Σπ² of that step; the arithmetic recipe also runs as a user runs
it (``geartrain train``, shortened). Kept short: no SFT, 4 prompts x 4 samples, 3 steps."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from e2e_helpers import QUICK, ROOT, rl_records, run_geartrain
from geartrain.algorithms import AdvantageConfig, compute_advantages
from geartrain.rewards import token_level_scores
from geartrain.trainer.config import load_train_config
from geartrain.trainer.preflight import preflight
from geartrain.trainer.rl import RLTrainer
from geartrain.trainer.run import Job

pytestmark = pytest.mark.e2e

ARITHMETIC = ROOT / "examples" / "arithmetic" / "otb.toml"
CALCULATOR = ROOT / "examples" / "calculator" / "tir_otb.toml"
STEPS = 3
CHEAP = [
    "sft.enabled=false",
    "validation.path=null",
    "data.batch_size=4",
    "sampling.n=4",
    "trainer.torch_threads=1",
    "actor.engine.optim.warmup_steps=0",
    "actor.engine.optim.lr_schedule=constant",
]


def text_hash_reward(response: str, ground_truth: str) -> float:
    """A reward that varies with the text, so the untrained policy's samples differ in reward
    (exact match would score them all 0, every advantage 0)."""
    return (sum(map(ord, response)) % 7) / 7


def train_steps(recipe: Path, tmp_path: Path) -> tuple[list[dict], list]:
    """``STEPS`` steps of ``recipe``; returns the step metrics and the batches the actor was
    updated on."""
    config = load_train_config(str(recipe), [*CHEAP, f"trainer.output_dir={tmp_path}"])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    job = Job(config)
    pre = preflight(config, reward_fn=text_hash_reward)
    job.reward_fn = pre.reward
    loader, _ = job._data(pre)
    trainer = RLTrainer(config, job.build_roles(config.model), pre.tokenizer, loader)
    updates = []
    call = trainer.roles.actor.call

    def spy(method, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if method == "update":
            updates.append(args[0])
        if method == "update_once":
            raise AssertionError("the optimal token baseline needs the separate old-log-prob forward")
        return call(method, *args, **kwargs)

    trainer.roles.actor.call = spy
    try:
        records = [trainer.step(step) for step in range(1, STEPS + 1)]
    finally:
        for group in (trainer.roles.actor, trainer.roles.reward):
            group.shutdown()
    return records, updates


@pytest.mark.parametrize(
    ("recipe", "estimator"),
    [(ARITHMETIC, "optimal_token_baseline"), (CALCULATOR, "tir_optimal_token_baseline")],
    ids=["arithmetic", "calculator"],
)
def test_otb_recipe_trains_on_the_engines_sum_pi_squared(recipe: Path, estimator: str, tmp_path: Path) -> None:
    assert load_train_config(str(recipe), check_plugins=False).algorithm.estimator == estimator
    records, updates = train_steps(recipe, tmp_path)
    assert len(updates) == STEPS
    assert all(math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["actor/grad_norm"]) for r in records)
    assert all(r["advantages/abs_mean"] > 0 for r in records)
    per_token_baseline = False
    for plan in updates:
        assert len(plan) == 1  # one epoch, one mini-batch: the step's batch in its order
        batch = plan[0]
        mask = batch["response_mask"].bool()
        spp, pi = batch["sum_pi_squared"], batch["old_log_probs"].exp()
        # Σπ² of a distribution lies in [π(y)², 1] for any token y of it
        assert bool((spp[mask] <= 1 + 1e-6).all()) and bool((spp[mask] >= pi[mask] ** 2 - 1e-6).all())
        rewards = token_level_scores(torch.tensor(batch["score"], dtype=torch.float32), batch["response_mask"])
        if "turn_rewards" in batch:
            rewards = rewards + batch["turn_rewards"]
        want, _ = compute_advantages(
            estimator,
            rewards,
            batch["response_mask"],
            group_ids=batch["uid"],
            old_log_probs=batch["old_log_probs"],
            sum_pi_squared=spp,
            config=AdvantageConfig(),
        )
        torch.testing.assert_close(batch["advantages"], want, atol=1e-6, rtol=0)
        for row in range(len(batch)):
            values = batch["advantages"][row][mask[row]]
            per_token_baseline |= len(values) > 1 and float(values.max() - values.min()) > 1e-4
    assert per_token_baseline, "OTB gives a baseline per token: some row's advantage must vary along it"
    if recipe == CALCULATOR:  # multi-turn episodes: some response masks have holes (tool outputs)
        assert any(_has_hole(m) for plan in updates for m in plan[0]["response_mask"])


def _has_hole(mask: torch.Tensor) -> bool:
    on = mask.nonzero().flatten()
    return len(on) > 0 and int(on[-1] - on[0] + 1) > len(on)


def test_arithmetic_otb_recipe_runs_as_a_user_runs_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_geartrain(
        "train",
        str(ARITHMETIC),
        f"trainer.output_dir={out}",
        *QUICK,
        "trainer.total_steps=3",
        "trainer.save_every=0",
        "validation.every_n_steps=3",
        "trainer.plot=false",
        "trainer.progress=false",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [r["actor/pg_loss"] for r in rl_records(out / "metrics.jsonl") if "actor/pg_loss" in r]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
