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

from geartrain.cluster.process_group import acquire_single_rank_group  # noqa: E402
from geartrain.config import EngineConfig, LoraConfig, ModelConfig, OptimConfig, RolloutConfig  # noqa: E402
from geartrain.engine import Engine  # noqa: E402
from geartrain.rollout import Rollout  # noqa: E402
from geartrain.testing.reference import make_batch, token_mean_nll_loss  # noqa: E402
from geartrain.testing.rollout_suite import encode_prompts  # noqa: E402
from geartrain.testing.tiny import tiny_model  # noqa: E402
from geartrain.types import EngineContext, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.slow]

MODEL = ModelConfig(tiny="qwen2", seed=2)
#: SGLang fp32 (torch_native attention and LoRA backends) against the fp32 trainer (measured
#: 9.5e-7 in both modes, 2026-11-26).
ATOL = 1e-5


def trained_engine(sync: str) -> Engine:
    lora = LoraConfig(rank=8, alpha=16, sync=sync)  # type: ignore[arg-type]
    config = EngineConfig(backend="fsdp", optim=OptimConfig(lr=2e-2, clip_grad=1.0), lora=lora)
    engine = Engine(config, MODEL, EngineContext(role="actor", process_group=acquire_single_rank_group("cpu")))
    for step in range(3):
        engine.forward_backward(make_batch([4, 6, 3], [7, 5, 8], seed=step), token_mean_nll_loss)
        engine.optimizer_step()
    return engine


def test_sglang_log_probs_equal_the_lora_engine_after_merged_and_adapter_sync(tmp_path: Path) -> None:
    config = RolloutConfig(
        backend="sglang", max_model_len=64, kv_cache_bytes=16 << 20, max_lora_rank=8,
        options={"work_dir": str(tmp_path / "sglang"), "seed": 0},
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
        print(f"max |SGLang - trainer| log-prob: {errors}")
        adapter_first, adapter_next = stats["adapter"]
        model = tiny_model("qwen2", seed=MODEL.seed)
        linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
        # rank-8 A [8, in] and B [out, 8] of every linear layer of the decoder, fp32
        adapter_bytes = sum(8 * (lin.in_features + lin.out_features) * 4 for lin in linears)
        base_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied head once
        assert adapter_next.bytes == adapter_bytes, (adapter_next.bytes, adapter_bytes)
        assert adapter_first.bytes == base_bytes + adapter_bytes, (adapter_first.bytes, base_bytes, adapter_bytes)
        assert adapter_next.bytes < stats["merged"][1].bytes / 5
    finally:
        rollout.shutdown()
