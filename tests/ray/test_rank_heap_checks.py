"""The dp=2 main job's steps under glibc's heap checks (issue 38): every piece that runs in
an actor rank at once (the update's gloo collectives, the generation sent right behind it
(``trainer.prefetch_generation``), the weight sync, a checkpoint, the heartbeat thread,
Ray's threads, and the SFT warm start whose engine (its device mesh's gloo groups) was built
and removed in the same rank processes before GRPO, as in the issue's job) runs with
``MALLOC_CHECK_=3``, ``MALLOC_PERTURB_`` and, where glibc has it, its debugging allocator
preloaded, so that a write into memory a rank does not own aborts the rank at once
(reported, with every thread's stack) instead of corrupting what comes later. The ranks
inherit the driver's environment: their logs say the checks were on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ray_helpers import MAIN_CONFIG, RAY2, SHORT, records, run_cli

pytestmark = [pytest.mark.slow]

STEPS = 40
SFT_STEPS = 20
#: glibc >= 2.34 honours MALLOC_CHECK_ only with this library preloaded
MALLOC_DEBUG = Path("/lib/x86_64-linux-gnu/libc_malloc_debug.so.0")
PERTURB = "165"


def test_dp2_job_steps_pass_glibc_heap_checks_in_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_CHECK_", "3")
    monkeypatch.setenv("MALLOC_PERTURB_", PERTURB)
    if MALLOC_DEBUG.exists():
        monkeypatch.setenv("LD_PRELOAD", str(MALLOC_DEBUG))
    out = tmp_path / "run"
    proc = run_cli(
        "train",
        str(MAIN_CONFIG),
        *SHORT,
        *RAY2,
        "sft.enabled=true",
        f"sft.steps={SFT_STEPS}",
        "sft.min_steps=0",
        f"trainer.total_steps={STEPS}",
        "trainer.save_every=10",
        f"trainer.output_dir={out}",
    )
    rank_logs = sorted((out / "logs").glob("actor-rank*.log"))
    tails = "\n".join(f"{log.name}:\n{log.read_text()[-3000:]}" for log in rank_logs)
    assert proc.returncode == 0, proc.stderr[-3000:] + tails
    assert [r["step"] for r in records(out / "metrics.jsonl")] == list(range(STEPS + 1))
    sft = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("phase") == "sft"]
    assert len(sft) == SFT_STEPS, len(sft)
    assert len(rank_logs) == 2, rank_logs
    for log in rank_logs:
        text = log.read_text()
        assert f"MALLOC_CHECK_=3 MALLOC_PERTURB_={PERTURB}" in text, text[:2000]  # the checks reached the rank
        assert "Fatal Python error" not in text, text[-3000:]
