"""``rollout.placement = "separate"`` with a multi-rank trainer: FSDP ``dp = 2`` trainer ranks
+ 2 torch rollout replicas, ``max_staleness = 0``, against the colocated ``dp = 2`` Ray run
(each rank generating its share; the same seeds):

* the same sampled responses and the same rewards, losses and gradient norms, bit for bit
  (the sharded trainer gathers its weights collectively for every broadcast, rank 0 sends);
* after every step each replica's weights equal the trainer's, bitwise, every tensor.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ray_helpers import RAY2, SHORT, assert_reproduces_colocated, recorded_run

pytestmark = [pytest.mark.slow]

STEPS = 4
KEYS = ("reward/mean", "reward/std", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac")
#: 2 trainer ranks + 2 replicas on the 2 CPUs Ray is given here
HALF = ["cluster.resources_per_rank={cpus=0.5}"]
SEPARATE = ["rollout.placement=separate", "rollout.replicas=2", "rollout.resources_per_replica={cpus=0.5}"]


def _run(out: Path, *extra: str) -> tuple[list[dict], list[list[str]], list[int]]:
    return recorded_run(out, [*SHORT, *RAY2, *HALF, f"trainer.total_steps={STEPS}", "trainer.save_every=0", *extra])


def test_separate_with_two_trainer_ranks_reproduces_colocated_dp2_exactly(tmp_path: Path) -> None:
    assert_reproduces_colocated(
        _run(tmp_path / "colocated"), _run(tmp_path / "separate", *SEPARATE), STEPS, KEYS, "the colocated dp=2 rollouts"
    )
