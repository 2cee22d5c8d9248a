"""The main job with ``rollout.placement = "separate"`` (1 trainer rank + 2 rollout replicas,
``algorithm.max_staleness = 1``: streamed, every sample at most one version old) learns like
the colocated one: its held-out gain is within 8 points of the colocated job's on the same
machine, from the same SFT warm start, and at least 15 points.

The GRPO schedule is shortened to STEPS steps (the cosine decay over STEPS, 20 warm-up
steps). Not a fixed +30 points: where the SFT warm start stops depends on the CPU's numerics
(it reaches its 30 % dev-accuracy stop inside a phase change): on the AMD EPYC VMs it stops at
340 steps (30.9 % held-out) and GRPO gains 40+ points; on an Intel Xeon VM (2026-11-28) at 320
steps (54.7 %), and 200 steps gained 24.6 points colocated and 23.4 separate."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from ray_helpers import MAIN_CONFIG, records, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

STEPS = 200
SEPARATE = [
    "cluster.placement=ray",
    "rollout.placement=separate",
    "rollout.replicas=2",
    "rollout.resources_per_replica={cpus=0.5}",
    "algorithm.max_staleness=1",
]
SHORTER = [
    f"trainer.total_steps={STEPS}",
    f"actor.engine.optim.total_steps={STEPS}",
    "actor.engine.optim.warmup_steps=20",
    f"validation.every_n_steps={STEPS}",
    "trainer.progress=false",
    "trainer.plot=false",
    "trainer.export_hf=false",
]


def _rl_records(out: Path) -> list[dict]:
    return [r for r in records(out / "metrics.jsonl") if r.get("phase") == "rl"]


def test_main_job_with_a_separate_rollout_learns_like_the_colocated_one(tmp_path: Path) -> None:
    out, inline = tmp_path / "run", tmp_path / "colocated"
    start = time.monotonic()
    proc = run_cli("train", str(MAIN_CONFIG), *SEPARATE, *SHORTER, f"trainer.output_dir={out}", timeout=1800)
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    proc = run_cli("train", str(MAIN_CONFIG), *SHORTER, f"trainer.output_dir={inline}", timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rl, reference = _rl_records(out), _rl_records(inline)
    before, after = rl[0]["val/accuracy"], rl[-1]["val/accuracy"]
    assert before == reference[0]["val/accuracy"], "both jobs start from the same SFT warm start"
    gain, colocated = 100 * (after - before), 100 * (reference[-1]["val/accuracy"] - before)
    print(
        f"main job, separate rollout (2 replicas, k = 1): {100 * before:.1f}% -> {100 * after:.1f}% in {seconds:.0f}s; "
        f"colocated: {colocated:+.1f} points"
    )
    assert gain >= max(15.0, colocated - 8.0), (
        f"gain {gain:.1f} points ({before} -> {after}), colocated {colocated:.1f}"
    )
    steps = rl[1:]
    assert len(steps) == STEPS
    assert max(r["async/staleness_max"] for r in steps) == 1.0  # it ran one version ahead, never more
