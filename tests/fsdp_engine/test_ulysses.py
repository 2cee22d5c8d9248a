"""Ulysses sequence parallel: sp=2 (2 gloo ranks, FSDP over both) against sp=1 (one
process) on a packed variable-length batch, for Qwen2 with fewer KV heads than sp
(repeated) and Llama (KV heads divisible by sp)."""

from __future__ import annotations

import pytest
import torch
from geartrain.config import ModelConfig
from geartrain.engine import Engine
from geartrain.types import EngineContext
from geartrain_fsdp.ulysses import kv_repeats_for

from .common import engine_config, full_grads, make_batch, run_ranks, token_mean_loss
from .workers import sequence_parallel_step


def _single(family: str, overrides: dict, budget: int) -> dict:
    engine = Engine(
        engine_config(budget=budget), ModelConfig(tiny=family, config_overrides=overrides), EngineContext(role="actor")
    )
    batch = make_batch(3, rows=5, prompt_max=9, response_max=12)
    res = engine.forward_backward(batch, token_mean_loss)
    return {"log_probs": res.outputs["log_probs"], "loss": res.metrics["loss"], "grads": full_grads(engine)}


@pytest.mark.parametrize(
    "family,overrides", [("qwen2", {"num_key_value_heads": 1}), ("llama", {})], ids=["qwen2-kv1", "llama-kv4"]
)
def test_sp2_matches_sp1(family: str, overrides: dict) -> None:
    budget = 40  # several packed micro-batches, each an odd number of tokens (filler needed)
    sp_ranks = run_ranks(sequence_parallel_step, 2, family, 2, overrides, budget)
    ref = _single(family, overrides, budget)
    for r in sp_ranks:  # both sp ranks return the whole slice
        assert torch.allclose(r["log_probs"], ref["log_probs"], atol=1e-5, rtol=0), (
            (r["log_probs"] - ref["log_probs"]).abs().max()
        )
        assert r["loss"] == pytest.approx(ref["loss"], abs=1e-6)
    for name, g in ref["grads"].items():
        assert torch.allclose(sp_ranks[0]["grads"][name], g, atol=1e-5, rtol=0), name


def test_kv_head_repeats() -> None:
    assert kv_repeats_for(4, 2, 2) == 1
    assert kv_repeats_for(4, 1, 2) == 2
    assert kv_repeats_for(8, 2, 4) == 2
    assert kv_repeats_for(12, 3, 2) == 2  # 3 KV heads, sp=2: 6 KV heads, groups of 2 query heads
    with pytest.raises(ValueError):
        kv_repeats_for(6, 2, 4)
