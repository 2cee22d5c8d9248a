"""The shortened agentic main job (examples/calculator) with a given rollout backend, and
what every backend must show: the 30-point gain of the torch rollout's test
(test_agent_job.py), multi-turn episodes that call the tool, and the trainer's log-probs of
the episodes' model tokens within 1e-3 of the engine's at every step (token in, token out:
every observation appended as the ids the engine continued from, every weight sync arrived)."""

from __future__ import annotations

from pathlib import Path

from e2e_helpers import ROOT, printed_accuracies, rl_records, run_geartrain

AGENT_CONFIG = ROOT / "examples" / "calculator" / "grpo.toml"
SHORT = (
    "validation.max_prompts=128",
    "trainer.plot=false",
    "trainer.export_hf=false",
    "trainer.tensorboard=false",
    "trainer.progress=false",
)


def check_agent_job_learns(backend: str, out: Path, *, steps: int = 50, min_gain: float = 30.0) -> None:
    """``steps`` GRPO steps must raise held-out accuracy by ``min_gain`` points."""
    schedule = (f"trainer.total_steps={steps}", f"validation.every_n_steps={steps}")
    proc = run_geartrain(
        "train",
        str(AGENT_CONFIG),
        f"rollout.backend={backend}",
        f"trainer.output_dir={out}",
        *schedule,
        *SHORT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = printed_accuracies(proc.stdout)
    assert after - before >= min_gain, f"{backend}: gain {after - before:.1f} points ({before}% -> {after}%)"
    records = rl_records(out / "metrics.jsonl")
    assert records[-1]["agent/turns_mean"] > 1.5, "episodes must call the tool, then answer"
    assert records[-1]["agent/tool_success_rate"] > 0.5
    mismatch = [r.get("rollout_mismatch/max_abs_diff") for r in records[1:]]
    assert len(mismatch) >= steps and None not in mismatch, "every step must report the log-prob mismatch"
    assert max(mismatch) < 1e-3, f"trainer vs {backend} log-probs of episodes differ by {max(mismatch):.3g}"
