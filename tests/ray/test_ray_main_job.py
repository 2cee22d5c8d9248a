"""The main job on 2 Ray ranks (FSDP dp=2, colocated torch rollouts, each generating half of
every step's prompts) learns like the inline one: on a quarter of the GRPO schedule (300
steps, the cosine decay over 300, as tests/e2e's SHORT_SCHEDULE) it closes a third of the gap to
100 % that the SFT warm start left, and gains at least 15 points (as tests/e2e's
``short_schedule_gain_needed``, which says why).

Not a fixed +30 points: where the warm start stops depends on the CPU's numerics (AMD EPYC:
30.9 % held-out; Intel Xeon: 54.7 %, see tests/e2e/e2e_helpers.py). The 600-step schedule
this test ran before took 3.2 min of the suite's CI budget at load."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from ray_helpers import MAIN_CONFIG, RAY2, records, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

SHORTER = [
    "trainer.total_steps=300",
    "actor.engine.optim.total_steps=300",
    "actor.engine.optim.warmup_steps=20",
    "validation.every_n_steps=100",
    "trainer.progress=false",
]


def test_main_job_on_two_ray_ranks_closes_a_third_of_the_gap_sft_left(tmp_path: Path) -> None:
    out = tmp_path / "run"
    start = time.monotonic()
    proc = run_cli("train", str(MAIN_CONFIG), *RAY2, *SHORTER, f"trainer.output_dir={out}", timeout=2400)
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    recs = records(out / "metrics.jsonl")
    before, after = recs[0]["val/accuracy"], recs[-1]["val/accuracy"]
    print(f"main job on 2 Ray ranks: {100 * before:.1f}% -> {100 * after:.1f}% in {seconds:.0f}s")
    gain, need = 100 * (after - before), max(15.0, (100.0 - 100 * before) / 3)
    assert gain >= need, f"gain {gain:.1f} points ({before} -> {after}), needed {need:.1f}"
    assert len(recs) == 301
    assert max(r["rollout_mismatch/max_abs_diff"] for r in recs[1:]) < 1e-3  # both replicas got every sync
