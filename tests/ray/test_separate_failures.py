"""The separate rollout's failures: a replica killed mid-run ends the job quickly with the
usual message naming it; ``--resume`` then finishes the run and says that the samples in
flight at the checkpoint were discarded and are generated again."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ray_helpers import MAIN_CONFIG, ROOT, SHORT, cli, records, run_cli

pytestmark = [pytest.mark.slow]

STEPS = 6
REWARD = Path(__file__).resolve().parent / "ray_helpers.py"
ARGS = [*SHORT, f"trainer.total_steps={STEPS}", "trainer.save_every=2", f"reward.function={REWARD}:paced_digit_reward",
        "cluster.placement=ray", "rollout.placement=separate", "rollout.replicas=2",
        "rollout.resources_per_replica={cpus=0.5}", "algorithm.max_staleness=1"]


def _steps_done(out: Path) -> int:
    path = out / "metrics.jsonl"
    return max((r["step"] for r in records(path)), default=-1) if path.exists() else -1


def test_killed_replica_ends_the_job_and_resume_regenerates_what_was_in_flight(tmp_path: Path) -> None:
    out = tmp_path / "run"
    log = (tmp_path / "driver.log").open("w")
    proc = subprocess.Popen(cli("train", str(MAIN_CONFIG), *ARGS, f"trainer.output_dir={out}"), cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 600
        while _steps_done(out) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        rank_log = (out / "logs" / "rollout-rank1.log").read_text()
        pid = int(re.search(r"pid (\d+)", rank_log).group(1))
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=120)
        seconds = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    text = (tmp_path / "driver.log").read_text()
    assert proc.returncode != 0, text[-2000:]
    assert "role 'rollout' rank 1" in text and "died" in text, text[-3000:]
    assert seconds < 60, f"the job took {seconds:.0f}s to notice the dead replica"
    assert _steps_done(out) < STEPS

    resumed = run_cli("train", str(MAIN_CONFIG), *ARGS, f"trainer.output_dir={out}", "--resume", timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "samples in flight at the checkpoint were not saved; they are discarded" in resumed.stdout
    steps = [r["step"] for r in records(out / "metrics.jsonl")]
    assert steps == list(range(STEPS + 1)), steps  # no step lost or repeated
