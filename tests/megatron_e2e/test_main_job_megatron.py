"""The main job with ``actor.engine.backend=megatron`` at TP2 on 2 Ray ranks (one model
replica split across both ranks, each rank's colocated torch rollout generating half of
every step's prompts from the full weights it was synced): SFT warm start then GRPO must
raise held-out accuracy by at least 30 points, and the trainer's log-probs of the rollout's
samples must agree with the rollout's own at every step (every sync arrived on both ranks).

Long (tens of minutes on 2 shared cores): run by ``make test-megatron-e2e``, outside
``make test``. The schedule is the one the FSDP dp=2 Ray main job uses (600 GRPO steps,
the cosine decay over 600); the figures of a run are in bench/RESULTS.md."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
MAIN_CONFIG = ROOT / "examples" / "arithmetic" / "grpo.toml"
MEGATRON_TP2 = [
    "cluster.placement=ray",
    "actor.engine.backend=megatron",
    "actor.engine.parallel.tp=2",
]
SHORTER = ["trainer.total_steps=600", "actor.engine.optim.total_steps=600", "trainer.progress=false"]


def _busy_cpu_seconds() -> float:
    """CPU seconds the whole machine spent busy since boot (all processes, /proc/stat)."""
    fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def test_main_job_megatron_tp2_on_two_ray_ranks_gains_30_points(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "geartrain.cli",
        "train",
        str(MAIN_CONFIG),
        *MEGATRON_TP2,
        *SHORTER,
        f"trainer.output_dir={out}",
    ]
    busy0, wall0, load0 = _busy_cpu_seconds(), time.monotonic(), os.getloadavg()
    proc = subprocess.run(
        cmd, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=5400
    )
    wall, busy, load1 = time.monotonic() - wall0, _busy_cpu_seconds() - busy0, os.getloadavg()
    own = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    recs = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("phase") == "rl"]
    before, after = recs[0]["val/accuracy"], recs[-1]["val/accuracy"]
    print(
        f"\nmegatron TP2 main job on 2 Ray ranks: {100 * before:.1f}% -> {100 * after:.1f}% in {wall:.0f} s wall; "
        f"CPU: driver + reaped children {own.ru_utime + own.ru_stime:.0f} s, whole machine busy {busy:.0f} s; "
        f"load average {load0[0]:.2f} -> {load1[0]:.2f}\n" + proc.stdout[-600:]
    )
    assert 100 * (after - before) >= 30.0, f"gain {100 * (after - before):.1f} points ({before} -> {after})"
    mismatch = [r.get("rollout_mismatch/max_abs_diff") for r in recs[1:]]
    assert len(mismatch) >= 599 and None not in mismatch, "every step must report the log-prob mismatch"
    assert max(mismatch) < 1e-3, f"trainer vs rollout log-probs differ by {max(mismatch):.3g} at some step"
