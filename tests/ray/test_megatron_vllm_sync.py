"""The megatron engine at TP2 (2 Ray ranks) streams its weights through
``reshard_for_rollout`` into a real vLLM rollout: after two training steps and the sync,
vLLM's log-probs of the tokens it samples equal the engine's log-probs of the same tokens
within 1e-4 (and differ from the untrained weights', so the sync is what made them equal)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from geartrain.config import EngineConfig, ModelConfig, OptimConfig, ParallelConfig, RolloutConfig
from geartrain.modeling import build_hf_model
from geartrain.rollout import Rollout
from geartrain.testing.reference import make_batch, token_mean_nll_loss
from geartrain.testing.rollout_suite import encode_prompts, teacher_forced_log_probs
from geartrain.types import EngineContext, SamplingParams

pytest.importorskip("geartrain_megatron")
pytest.importorskip("geartrain_vllm")

pytestmark = [pytest.mark.slow]

#: heads vLLM's CPU attention supports, kv heads that split over TP2
MODEL = ModelConfig(tiny="llama", seed=2, config_overrides={"num_attention_heads": 2, "num_key_value_heads": 2})


@pytest.fixture()
def engine() -> Iterator[object]:
    from geartrain.testing.multirank import RankedEngine, start_placement

    placement = start_placement(2, 0.5)
    config = EngineConfig(backend="megatron", parallel=ParallelConfig(tp=2), optim=OptimConfig(lr=1e-2, clip_grad=1.0))
    engine = RankedEngine(placement, config, MODEL, "actor", pool="megatron-tp2")
    try:
        yield engine
    finally:
        engine.close()
        placement.close()


def test_vllm_log_probs_equal_the_engine_after_sync(engine: object, tmp_path: Path) -> None:
    for step in range(2):
        engine.forward_backward(make_batch([4, 6, 3], [7, 5, 8], seed=step), token_mean_nll_loss)  # type: ignore[attr-defined]
        assert engine.optimizer_step()["skipped"] == 0.0  # type: ignore[attr-defined]
    config = RolloutConfig(
        backend="vllm",
        max_model_len=64,
        kv_cache_bytes=64 << 20,
        weight_bucket_bytes=64 << 10,
        options={"work_dir": str(tmp_path / "vllm")},
    )
    rollout = Rollout(config, MODEL, EngineContext(role="rollout"))
    try:
        stats = engine.sync_weights(rollout)  # type: ignore[attr-defined]
        assert stats.num_buckets > 1
        sampled = rollout.generate(encode_prompts(), SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=3))
    finally:
        rollout.shutdown()
    ours = engine.compute_log_probs(sampled).outputs["log_probs"]  # type: ignore[attr-defined]
    mask = sampled["response_mask"].bool()
    assert mask.sum() > 20
    diff = (ours[mask] - sampled["rollout_log_probs"][mask]).abs().max()
    print(f"\nmegatron TP2 vs vLLM log-probs after sync: max |diff| {float(diff):.2e} over {int(mask.sum())} tokens")
    torch.testing.assert_close(ours[mask], sampled["rollout_log_probs"][mask], atol=1e-4, rtol=0)
    untrained = teacher_forced_log_probs(build_hf_model(MODEL), sampled)
    assert (untrained[mask] - sampled["rollout_log_probs"][mask]).abs().max() > 1e-2, (
        "training did not move the weights"
    )
