"""bench/gpu/real_trl_check.py (issue 32 item 5 on a GPU: geartrain vs TRL on the real model in
bf16) works: its CPU dry run on a tiny random Llama goes through geartrain's side (and TRL's
where trl is installed), with the shared evaluator agreeing with geartrain's own rollout."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench/gpu/real_trl_check.py"
STEPS = 3


def dry_run(tmp_path: Path, dtype: str) -> dict:
    cmd = [sys.executable, str(SCRIPT), "--dry-run", "--device", "cpu", "--dtype", dtype, "--steps", str(STEPS)]
    cmd += ["--eval-every", "2", "--held-out", "8", "--batch", "2", "--n", "2", "--max-tokens", "4", "--threads", "1"]
    out = tmp_path / f"{dtype}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_trl_script_dry_run_on_cpu(tmp_path: Path, dtype: str) -> None:
    results = dry_run(tmp_path, dtype)
    engine = results["geartrain_engine"]
    assert engine["param_dtype"] == engine["rollout_dtype"] == dtype
    # bf16 runs on FSDP2's one-rank mesh (DTensors), which the evaluator must gather
    assert engine["one_rank_mesh"] == (dtype == "bfloat16")
    gear = results["geartrain"]
    assert gear["steps"] == STEPS and len(gear["wall_s_per_step"]) == STEPS
    assert [s for s, _ in gear["held_out_accuracy_by_step"]] == [0, 2, 3]
    assert results["geartrain_stop"]["reason"] == "steps"
    if dtype == "float32":
        # same weights, greedy: geartrain's rollout and the shared evaluator's generate agree
        assert results["geartrain_greedy_tokens0_identical_to_fp32_evaluator"] == 1.0
    if importlib.util.find_spec("trl") is None:
        assert results["trl_skipped"].startswith("trl does not import here")
        return
    fairness = results["fairness"]
    assert fairness["start_accuracy_equal"] and fairness["lr_max_abs_diff"] == 0.0
    assert fairness["same_prompts_same_order_steps"] == fairness["trl_steps"] == STEPS
    assert results["trl"]["steps"] == STEPS
    if dtype == "float32":
        assert fairness["greedy_tokens_identical_geartrain_vs_trl"] == 1.0
