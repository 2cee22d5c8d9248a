"""``rollout.placement = "separate"`` on Ray: 1 trainer rank + 2 rollout replicas.

* ``max_staleness = 0`` reproduces the colocated run (1 Ray rank, the same seeds) exactly:
  the same sampled responses and the same rewards, losses and gradient norms, bit for bit;
  after every step each replica's weights equal the trainer's, bitwise.
* ``max_staleness = k`` (1, 2): every sample's recorded version gap is at most k, and the
  pipeline runs k steps ahead (the gap reaches k).
* streaming under simulated long-tail latency: each step trains the first finished groups,
  across loader batches, still within k.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ray_helpers import SHORT, assert_reproduces_colocated, recorded_run

pytestmark = [pytest.mark.slow]

STEPS = 5
KEYS = ("reward/mean", "reward/std", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac")
SEPARATE = ["rollout.placement=separate", "rollout.replicas=2", "rollout.resources_per_replica={cpus=0.5}"]


def _run(out: Path, *extra: str) -> tuple[list[dict], list[list[str]], list[int]]:
    return recorded_run(
        out, [*SHORT, f"trainer.total_steps={STEPS}", "trainer.save_every=0", "cluster.placement=ray", *extra]
    )


def test_separate_at_staleness_0_reproduces_colocated_exactly(tmp_path: Path) -> None:
    assert_reproduces_colocated(
        _run(tmp_path / "colocated"), _run(tmp_path / "separate", *SEPARATE), STEPS, KEYS, "the colocated rollout"
    )


@pytest.mark.parametrize("k", [1, 2])
def test_separate_staleness_stays_within_k(tmp_path: Path, k: int) -> None:
    recs, _, checked = _run(tmp_path / f"k{k}", *SEPARATE, f"algorithm.max_staleness={k}")
    steps = recs[1:]
    assert len(steps) == STEPS
    gaps = [g for r in steps for g in r["samples/staleness"]]
    assert max(gaps) <= k, gaps
    assert steps[-1]["async/staleness_max"] == k, [r["async/staleness_max"] for r in steps]  # it ran k steps ahead
    assert all("async/is_weight_mean" in r for r in steps)  # truncated IS applied to the stale samples
    assert len(checked) == STEPS and min(checked) > 0, checked


def test_streaming_trains_the_first_finished_groups_within_k(tmp_path: Path) -> None:
    """Simulated long-tail generation (per-sample finish times): a step's batch is the first
    finished GRPO groups, whole, from more than one loader batch, none more than k = 1
    versions old; too-stale groups are dropped and counted; the weights still match."""
    recs, texts, checked = _run(
        tmp_path / "stream",
        *SEPARATE,
        "algorithm.max_staleness=1",
        "rollout.options.simulated_token_s=0.002",
        "rollout.options.simulated_tail_alpha=0.8",
    )
    steps = recs[1:]
    assert len(steps) == STEPS and all(len(t) == len(texts[0]) for t in texts)  # every step a full batch
    assert max(g for r in steps for g in r["samples/staleness"]) <= 1
    assert max(r["async/loader_batches"] for r in steps) >= 2, [r["async/loader_batches"] for r in steps]
    assert all("async/dropped_groups" in r for r in steps)
    assert len(checked) == STEPS and min(checked) > 0, checked
