"""The agentic main job (examples/calculator), shortened: SFT on tool-use traces, then GRPO on
multi-turn episodes with the calculator tool must raise held-out episode accuracy by at least
30 points, with the agent metrics and a rendered episode logged; the same start without the
tool (the control) does not gain. (The full job's figures are in bench/RESULTS.md.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_helpers import ROOT, printed_accuracies, rl_records, run_geartrain

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

AGENT_CONFIG = ROOT / "examples" / "calculator" / "grpo.toml"
SHORT = (
    "trainer.total_steps=50",
    "validation.every_n_steps=50",
    "validation.max_prompts=128",
    "trainer.plot=false",
    "trainer.export_hf=false",
    "trainer.tensorboard=false",
    "trainer.progress=false",
)


def test_agent_job_gains_30_points_and_the_control_does_not(tmp_path: Path) -> None:
    out = tmp_path / "agent"
    proc = run_geartrain("train", str(AGENT_CONFIG), f"trainer.output_dir={out}", *SHORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = printed_accuracies(proc.stdout)
    assert after - before >= 30.0, f"gain {after - before:.1f} points ({before}% -> {after}%)"
    records = rl_records(out / "metrics.jsonl")
    last = records[-1]
    for key in (
        "agent/turns_mean",
        "agent/tool_calls",
        "agent/tool_errors",
        "agent/tool_success_rate",
        "agent/tool_latency_p50_s",
        "agent/tool_latency_p95_s",
        "agent/truncated",
        "agent/model_tokens_mean",
        "agent/observation_tokens_mean",
        "rollout_mismatch/max_abs_diff",
    ):
        assert key in last, key
    assert last["agent/turns_mean"] > 1.5  # it calls the tool, then answers
    assert last["agent/tool_success_rate"] > 0.5
    assert max(r["rollout_mismatch/max_abs_diff"] for r in records[1:]) < 1e-3  # token in, token out
    log = (out / "episodes.log").read_text()
    assert "[model] '[calc " in log and "[obs] '(" in log

    control = tmp_path / "control"
    proc = run_geartrain(
        "train",
        str(AGENT_CONFIG),
        f"trainer.output_dir={control}",
        "sft.enabled=false",
        "model.tiny=null",
        f"model.path={out / 'sft_model'}",
        "rollout.agent.environment_kwargs.enabled=false",
        *SHORT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    c_before, c_after = printed_accuracies(proc.stdout)
    assert c_after < 5.0, f"without the tool the policy reached {c_after}%"
    assert rl_records(control / "metrics.jsonl")[-1]["agent/tool_success_rate"] == 0.0
