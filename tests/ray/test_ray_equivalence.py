"""Two FSDP ranks on Ray (colocated torch rollouts, each generating its share) against the
same job inline: the same sampled tokens and, for the first five steps, the same rewards,
losses and gradient norms."""

from __future__ import annotations

from pathlib import Path

import geartrain.trainer.rl as rl
import pytest
from geartrain.batch import Batch
from geartrain.trainer.config import load_train_config
from geartrain.trainer.run import run_job
from ray_helpers import MAIN_CONFIG, RAY2, SHORT, digit_reward, records

pytestmark = [pytest.mark.slow]

STEPS = 5
KEYS = ("reward/mean", "reward/std", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac")


def _run(out: Path, *extra: str) -> tuple[list[dict], list[list[str]]]:
    """The job's metric records and, per step, the responses it scored (in row order: the
    rule reward runs in the driver on the gathered batch)."""
    seen: list[list[str]] = []
    original = rl.RLTrainer._score

    def score(self: rl.RLTrainer, batch: Batch) -> object:
        seen.append(list(batch["response_text"]))
        return original(self, batch)

    config = load_train_config(
        MAIN_CONFIG,
        [*SHORT, f"trainer.total_steps={STEPS}", "trainer.save_every=0", f"trainer.output_dir={out}", *extra],
    )
    rl.RLTrainer._score = score  # type: ignore[method-assign]
    try:
        run_job(config, reward_fn=digit_reward)
    finally:
        rl.RLTrainer._score = original  # type: ignore[method-assign]
    return records(out / "metrics.jsonl"), seen


def test_grpo_on_two_ray_ranks_matches_inline(tmp_path: Path) -> None:
    inline, inline_texts = _run(tmp_path / "inline")
    ray2, ray_texts = _run(tmp_path / "ray", *RAY2)
    assert len(inline_texts) == len(ray_texts) == STEPS
    assert ray_texts == inline_texts, "the two placements sampled different tokens"
    assert any(r["actor/grad_norm"] > 0 for r in inline[1:]), "no gradient: the comparison would be empty"
    for a, b in zip(inline[1:], ray2[1:], strict=True):
        for key in KEYS:
            assert abs(a[key] - b[key]) <= 1e-4, (a["step"], key, a[key], b[key])
    # two replicas synced and generated: the bytes synced are summed over both ranks
    assert ray2[2]["hybrid/weight_sync_bytes"] == 2 * inline[2]["hybrid/weight_sync_bytes"]
