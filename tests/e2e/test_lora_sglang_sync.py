"""LoRA adapters trained by the fsdp engine reach a real SGLang rollout (sglang.Engine, CPU
recipe) both ways: merged weights (``W + scale B A`` under the transformers names) and
adapter only (the base once, then the adapter through SGLang's in-memory
``load_lora_adapter_from_tensors``). After each sync, SGLang's log-probs of the tokens it
samples equal the engine's log-probs of the same tokens within 1e-5 (fp32), and differ from
the base's, so the adapter is what made them equal. Runs in .venvs/sglang with the FSDP
engine added (make test-sglang-e2e)."""

from __future__ import annotations

import pytest

pytest.importorskip("geartrain_sglang")
pytest.importorskip("geartrain_fsdp")
pytest.importorskip("sglang")
pytest.importorskip("peft")

from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from geartrain.config import ModelConfig, RolloutConfig  # noqa: E402
from geartrain.rollout import Rollout  # noqa: E402
from geartrain.testing.lora_sync import SYNC_MODES, lora_sync_gaps  # noqa: E402
from geartrain.testing.tiny import tiny_model  # noqa: E402
from geartrain.types import EngineContext  # noqa: E402

pytestmark = [pytest.mark.slow]

MODEL = ModelConfig(tiny="qwen2", seed=2)
#: SGLang fp32 (torch_native attention and LoRA backends) against the fp32 trainer (measured
#: 9.5e-7 in both modes, 2026-11-26).
ATOL = 1e-5


def test_sglang_log_probs_equal_the_lora_engine_after_merged_and_adapter_sync(tmp_path: Path) -> None:
    config = RolloutConfig(
        backend="sglang",
        max_model_len=64,
        kv_cache_bytes=16 << 20,
        max_lora_rank=8,
        options={"work_dir": str(tmp_path / "sglang"), "seed": 0},
    )
    rollout = Rollout(config, MODEL, EngineContext(role="rollout"))
    try:
        gaps = lora_sync_gaps(rollout, MODEL, rank=8)
    finally:
        rollout.shutdown()
    print(f"max |SGLang - trainer| log-prob: {gaps.trained}")
    for sync in SYNC_MODES:
        assert gaps.trained[sync] <= ATOL, (sync, gaps.trained[sync])
        assert gaps.base[sync] > 100 * ATOL, sync  # the adapter is what made them equal
    adapter_first, adapter_next = gaps.syncs["adapter"]
    model = tiny_model("qwen2", seed=MODEL.seed)
    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    # rank-8 A [8, in] and B [out, 8] of every linear layer of the decoder, fp32
    adapter_bytes = sum(8 * (lin.in_features + lin.out_features) * 4 for lin in linears)
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied head once
    assert adapter_next.bytes == adapter_bytes, (adapter_next.bytes, adapter_bytes)
    assert adapter_first.bytes == base_bytes + adapter_bytes, (adapter_first.bytes, base_bytes, adapter_bytes)
    assert adapter_next.bytes < gaps.syncs["merged"][1].bytes / 5
