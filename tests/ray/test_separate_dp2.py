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

from ray_helpers import RAY2, SHORT, recorded_run

pytestmark = [pytest.mark.slow]

STEPS = 4
KEYS = ("reward/mean", "reward/std", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac")
#: 2 trainer ranks + 2 replicas on the 2 CPUs Ray is given here
HALF = ["cluster.resources_per_rank={cpus=0.5}"]
SEPARATE = ["rollout.placement=separate", "rollout.replicas=2", "rollout.resources_per_replica={cpus=0.5}"]


def _run(out: Path, *extra: str) -> tuple[list[dict], list[list[str]], list[int]]:
    return recorded_run(out, [*SHORT, *RAY2, *HALF, f"trainer.total_steps={STEPS}", "trainer.save_every=0", *extra])


def test_separate_with_two_trainer_ranks_reproduces_colocated_dp2_exactly(tmp_path: Path) -> None:
    colocated, colocated_texts, _ = _run(tmp_path / "colocated")
    separate, separate_texts, checked = _run(tmp_path / "separate", *SEPARATE)
    assert len(colocated_texts) == len(separate_texts) == STEPS
    assert separate_texts == colocated_texts, "the separate replicas sampled other tokens than the colocated dp=2 rollouts"
    assert any(r["actor/grad_norm"] > 0 for r in colocated[1:]), "no gradient: the comparison would be empty"
    for a, b in zip(colocated[1:], separate[1:], strict=True):
        for key in KEYS:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
        assert b["async/staleness_max"] == 0.0
    assert len(checked) == STEPS and min(checked) > 0, checked  # every tensor, bitwise, on both replicas
