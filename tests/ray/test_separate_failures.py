"""The separate rollout's failures: a replica killed mid-run ends the job quickly with the
usual message naming it; ``--resume`` then finishes the run and says that the samples in
flight at the checkpoint were discarded and are generated again."""

from __future__ import annotations

from pathlib import Path

import pytest
from ray_helpers import MAIN_CONFIG, SHORT, kill_mid_run, records, run_cli, steps_done

pytestmark = [pytest.mark.slow]

STEPS = 6
REWARD = Path(__file__).resolve().parent / "ray_helpers.py"
ARGS = [
    *SHORT,
    f"trainer.total_steps={STEPS}",
    "trainer.save_every=2",
    f"reward.function={REWARD}:paced_digit_reward",
    "cluster.placement=ray",
    "rollout.placement=separate",
    "rollout.replicas=2",
    "rollout.resources_per_replica={cpus=0.5}",
    "algorithm.max_staleness=1",
]
#: A killed replica's heartbeat stops too: were its death not noticed at once, the heartbeat
#: would end the wait on it this long after the kill. The bound is half of it (measured: ~3 s).
KILLED_HEARTBEAT_S = 300


def test_killed_replica_ends_the_job_and_resume_regenerates_what_was_in_flight(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = kill_mid_run(
        tmp_path, [*ARGS, f"cluster.heartbeat_timeout_s={KILLED_HEARTBEAT_S}"], "rollout-rank1.log", after_step=3
    )
    assert run.returncode != 0, run.text[-2000:]
    # noticed as a death at once (and the job torn down), not by the heartbeat's deadline
    assert run.seconds < KILLED_HEARTBEAT_S / 2, f"the job took {run.seconds:.0f}s to notice the dead replica"
    assert "role 'rollout' rank 1" in run.text and "died" in run.text, run.text[-3000:]
    assert steps_done(out) < STEPS

    resumed = run_cli("train", str(MAIN_CONFIG), *ARGS, f"trainer.output_dir={out}", "--resume")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "samples in flight at the checkpoint were not saved; they are discarded" in resumed.stdout
    steps = [r["step"] for r in records(out / "metrics.jsonl")]
    assert steps == list(range(STEPS + 1)), steps  # no step lost or repeated
