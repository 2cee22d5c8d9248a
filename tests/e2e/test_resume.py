"""Kill the main job (SIGKILL) during GRPO, rerun it with ``--resume``: it continues from
the newest complete checkpoint, the JSONL has every step exactly once, and every step's
numbers equal those of an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from e2e_helpers import JOB_HANG_GUARD_S, MAIN_CONFIG, QUICK, ROOT, geartrain_cmd, rl_records, run_geartrain

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOTAL = 12
ARGS = [*QUICK, f"trainer.total_steps={TOTAL}", "trainer.save_every=4", "validation.every_n_steps=6"]


def _last_rl_step(path: Path) -> int:
    if not path.exists():
        return -1
    steps = [-1]
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("phase") == "rl":
            steps.append(int(record["step"]))
    return max(steps)


def test_sigkill_then_resume_matches_uninterrupted(tmp_path: Path) -> None:
    reference_dir, killed_dir = tmp_path / "reference", tmp_path / "killed"
    proc = run_geartrain("train", str(MAIN_CONFIG), *ARGS, f"trainer.output_dir={reference_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]

    child = subprocess.Popen(
        geartrain_cmd("train", str(MAIN_CONFIG), *ARGS, f"trainer.output_dir={killed_dir}"),
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + JOB_HANG_GUARD_S  # a hang guard: step 5 ends the wait
        while _last_rl_step(killed_dir / "metrics.jsonl") < 5:  # step 4's checkpoint is written
            assert child.poll() is None, "the job ended before it could be killed"
            assert time.monotonic() < deadline, "the job made no progress"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
    killed_at = _last_rl_step(killed_dir / "metrics.jsonl")
    assert 5 <= killed_at < TOTAL, f"killed after step {killed_at}"

    resumed = run_geartrain("train", str(MAIN_CONFIG), *ARGS, f"trainer.output_dir={killed_dir}", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    match = re.search(r"resumed from \S+ \(step (\d+)\)", resumed.stdout)
    assert match, resumed.stdout[-2000:]
    assert int(match.group(1)) % 4 == 0 and 4 <= int(match.group(1)) <= killed_at

    records = rl_records(killed_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(TOTAL + 1))
    reference = rl_records(reference_dir / "metrics.jsonl")
    for mine, ref in zip(records, reference, strict=True):
        for key in ("reward/mean", "actor/grad_norm", "actor/pg_loss", "val/accuracy"):
            if key in ref:
                assert mine[key] == pytest.approx(ref[key], abs=1e-6), (mine["step"], key)
    sft_steps = [
        r["step"]
        for r in map(json.loads, (killed_dir / "metrics.jsonl").read_text().splitlines())
        if r["phase"] == "sft"
    ]
    assert sft_steps == list(range(1, 21))  # the warm start ran once and was not repeated
