"""bench/gpu/issue33_check.py (issue 33's GPU run) works: its CPU dry run on the tiny model
goes through the decode (GQA-native and transformers' attention), update-MFU, GRPO and
LoRA-memory sections without an error and reports the accounting's figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench/gpu/issue33_check.py"


def test_issue33_script_dry_run_on_cpu(tmp_path: Path) -> None:
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--dry-run"]
    cmd += ["--sections", "decode", "mfu05", "grpo_geartrain", "lora_memory", "decode_skewed", "--compact-every", "2"]
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "BENCH_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((tmp_path / "issue33.json").read_text())
    errors = {k: v for k, v in results.items() if k.endswith("_error") or k.endswith("_skipped")}
    assert not errors, errors
    gqa, hf = results["decode_gqa_forward_batch8"], results["decode_hf_forward_batch8"]
    assert gqa["decode_attention"] == "geartrain_gqa_decode" and hf["decode_attention"] == "sdpa"
    for decoded in (gqa, hf):
        assert decoded["generated_tokens"] == 8 * 8
        assert decoded["mean_abs_logp_vs_hf_forward"] < 1e-4  # fp32 on CPU: the decode equals a forward
        # live KV bytes grow from the prompt to the full width: below the static cache's width
        assert 0 < decoded["live_bytes_per_step_mean"] < decoded["static_width_bytes_per_step"]
    mfu = results["mfu_qwen2.5-0.5b"]
    assert mfu["computed_tokens"] > 0 and 0 < mfu["attention_share_of_flops"] < 1
    assert mfu["one_rank_mesh"] and mfu["fused_log_probs"] and not mfu["compiled"]  # CPU: compile off by default
    grpo = results["grpo_update_accounting"]
    assert grpo["computed_tokens"] == 4 * 8 + 16 * 8 < grpo["counted_tokens_without_sharing"] == 16 * 16
    off, on = results["decode_skewed_compact0_batch8"], results["decode_skewed_compact2_batch8"]
    assert off["generated_tokens"] == on["generated_tokens"] < 8 * 8  # skewed budgets, same tokens either way
    assert results["decode_skewed_compaction_speedup"] > 0
    lora = results["lora_memory"]
    assert lora["gradient_checkpointing"] and lora["full_peak_gib"] > 0 and lora["lora_over_full_peak"] > 0


def test_a_bad_decode_variant_is_one_line_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--dry-run", "--decode-variants", "gqa:fast"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "'gqa:fast' is not <gqa|hf>:<step|forward|none>" in proc.stderr


def test_isolated_sections_report_through_their_child_processes(tmp_path: Path) -> None:
    """``--isolate`` (the default on CUDA): each section runs in a child of the script and
    its figures reach the parent's results."""
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--dry-run", "--isolate", "--budget", "300"]
    cmd += ["--sections", "decode", "--decode-variants", "gqa:none"]
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((tmp_path / "issue33.json").read_text())
    assert not {k for k in results if k.endswith("_error")}, results
    assert results["decode_gqa_none_batch8"]["generated_tokens"] == 8 * 8
    assert results["device"]["name"] == "cpu" and "total_s" in results
