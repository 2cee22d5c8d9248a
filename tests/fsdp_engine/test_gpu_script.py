"""bench/gpu/issue20_check.py (the issue-20 GPU run) works: its CPU dry run on the tiny model
goes through every section but the memory search (tested in test_bench_memory) without an
error, its attention check finds the flash layout equal to SDPA, and its update-MFU section
measures the eager and the compiled (inductor) engine, which train alike."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_script_dry_run_on_cpu(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        str(ROOT / "bench/gpu/issue20_check.py"),
        "--device",
        "cpu",
        "--dry-run",
        "--sections",
        "attention",
        "mfu05",
        "decode",
        "grpo",
        "--profile-decode",
        "--profile-update",
    ]
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((tmp_path / "issue20.json").read_text())
    errors = {k: v for k, v in results.items() if k.endswith("_error")}
    assert not errors, errors
    for layout in ("packed", "shared_prompts"):
        check = results[f"attention_{layout}_flash_layout_via_sdpa"]
        assert check["max_err_vs_sdpa"] < 1e-5 and check["grad_max_err"] < 1e-5
    eager, compiled = results["mfu_qwen2.5-0.5b"], results["mfu_qwen2.5-0.5b_compiled"]
    assert eager["tokens_per_step"] > 0 and compiled["tokens_per_step"] == eager["tokens_per_step"]
    assert (eager["compile"], compiled["compile"]) == ("off", "inductor")
    # the same steps on the same weights (bf16 autocast on CPU): the compiled layers train alike
    assert abs(compiled["grad_norm"] - eager["grad_norm"]) < 1e-2 * eager["grad_norm"]
    assert results["mfu_qwen2.5-0.5b_compile_speedup"] > 0
    assert results["mfu_qwen2.5-0.5b_profile_top_ops"] and results["mfu_qwen2.5-0.5b_compiled_profile_top_ops"]
    for graph in ("step", "forward"):
        decoded = results[f"decode_batch4_{graph}"]
        assert decoded["generated_tokens"] == 4 * 8  # every row runs to max_tokens
        assert decoded["mean_abs_logp_vs_hf_forward"] < 1e-4  # fp32 on CPU: the decode equals a plain forward
    assert results["decode_batch4_step"]["profile_top_ops"]
    # the same weights on both sides (engine bf16 vs fp32 rollout on CPU): a bf16-sized mismatch
    assert max(results["grpo_geartrain"]["mean_abs_logp_mismatch_per_step"]) < 1e-2
    ours = results["grpo_geartrain"]  # the phases are parts of the step
    assert 0 < ours["sync_weights_s"] + ours["generate_s"] + ours["update_s"] <= ours["step_s"] * 1.5


def run_script(tmp_path: Path, *args: str) -> dict:
    cmd = [sys.executable, str(ROOT / "bench/gpu/issue20_check.py"), "--device", "cpu", "--dry-run", *args]
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((tmp_path / "issue20.json").read_text())


def test_isolated_sections_survive_a_crash_and_fall_back_to_the_forward_graph(tmp_path: Path) -> None:
    """``--isolate`` (the default on CUDA): a section whose process dies (as on a CUDA error)
    costs that section only; what it recorded before still arrives; a failed ``"step"``
    decode makes the GRPO step decode with ``"forward"``."""
    results = run_script(
        tmp_path, "--isolate", "--fault", "crash", "--sections", "decode", "grpo", "--decode-graphs", "step", "forward"
    )
    for label in ("decode_step", "decode_forward", "grpo_geartrain", "grpo_trl"):
        assert results[f"{label}_error"] == "child process: exit status 134", label
    assert results["decode_before_fault"] == 1  # written by the child before it died
    assert "'step' decode failed" in results["grpo_decode_graph_fallback"]
    assert "total_s" in results


def test_isolated_section_that_hangs_is_killed_at_the_budget(tmp_path: Path) -> None:
    budget, grace = 3, 1
    results = run_script(
        tmp_path,
        "--isolate",
        "--fault",
        "hang",
        "--budget",
        str(budget),
        "--child-grace",
        str(grace),
        "--sections",
        "mfu05",
    )
    killed = re.fullmatch(
        r"child process: killed after (\d+) s \(the budget left was (\d+) s\): a hang\?", results["mfu05_error"]
    )
    assert killed, results["mfu05_error"]
    # the hanging child (it sleeps for days) was killed once the budget left and the grace ran
    # out, not later: a timer's deadline, so the bound (twice it) does not depend on machine load
    seconds, left = int(killed.group(1)), int(killed.group(2))
    assert left <= budget and seconds < 2 * (left + grace), results["mfu05_error"]
    assert results["total_s"] < 2 * (budget + grace)  # and the parent did not wait on it either


def test_isolated_sections_measure_as_in_one_process(tmp_path: Path) -> None:
    """The figures of isolated sections are those of the in-process run (same seeds)."""
    one = run_script(tmp_path, "--sections", "decode", "--decode-graphs", "forward")
    iso = run_script(tmp_path, "--isolate", "--sections", "decode", "--decode-graphs", "forward")
    for rows in (4, 8):
        a, b = one[f"decode_batch{rows}_forward"], iso[f"decode_batch{rows}_forward"]
        assert a["generated_tokens"] == b["generated_tokens"]
        assert a["mean_abs_logp_vs_hf_forward"] < 1e-4 and b["mean_abs_logp_vs_hf_forward"] < 1e-4
    assert "decode_forward_error" not in iso and iso["decode_forward_process_s"] > 0
