"""bf16 done right (issue 20 item 2), on CPU: FSDP2's MixedPrecisionPolicy (here on a one-rank
group, as a one-GPU job with cpu_offload runs) computes in bf16 from fp32 master weights with
fp32 AdamW state; log-probs and entropy come out fp32, within bf16 tolerance of the fp32
engine, and the vocabulary projection never sees more than ``logits_chunk_tokens`` rows."""

from __future__ import annotations

import pytest
import torch
from geartrain.cluster.process_group import acquire_single_rank_group, release_single_rank_group
from geartrain.config import EngineConfig, ModelConfig
from geartrain.engine import Engine
from geartrain.types import EngineContext
from geartrain_fsdp import logprobs

from .common import engine_config, make_batch, token_mean_loss


def build(dtype: str, group: object, chunk: int) -> Engine:
    cfg = engine_config(budget=10_000, options={"cpu_offload": True, "logits_chunk_tokens": chunk})
    cfg = EngineConfig(**{**cfg.model_dump(), "param_dtype": dtype})
    return Engine(cfg, ModelConfig(tiny="qwen2"), EngineContext(role="actor", process_group=group))


def test_mixed_precision_policy_bf16_compute_fp32_master_and_chunked_fp32_log_probs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[torch.dtype, torch.dtype, int]] = []
    real = logprobs._chunk

    def spy(hidden, weight, targets, need_entropy):  # noqa: ANN001, ANN202
        seen.append((hidden.dtype, weight.dtype, hidden.shape[0]))
        return real(hidden, weight, targets, need_entropy)

    monkeypatch.setattr(logprobs, "_chunk", spy)
    group = acquire_single_rank_group("cpu")
    try:
        batch = make_batch(5, rows=8)
        batch.info["need_entropy"] = True
        bf16, fp32 = build("bfloat16", group, chunk=16), build("float32", group, chunk=16)
        assert bf16.handle.meshes.distributed  # FSDP2 with its MixedPrecisionPolicy
        a = bf16.forward_backward(batch, token_mean_loss)
        compute = list(seen)
        seen.clear()
        b = fp32.forward_backward(batch, token_mean_loss)
        tokens = int(batch["attention_mask"].sum())
        assert tokens > 16 and max(rows for *_, rows in compute) <= 16  # chunked
        assert {(h, w) for h, w, _ in compute} == {(torch.bfloat16, torch.bfloat16)}  # bf16 activations/params
        assert {(h, w) for h, w, _ in seen} == {(torch.float32, torch.float32)}
        mask = batch["attention_mask"].bool() & (batch["attention_mask"].cumsum(1) > 1)
        for key in ("log_probs", "entropy"):
            assert a.outputs[key].dtype == torch.float32
            diff = (a.outputs[key] - b.outputs[key]).abs()[mask]
            assert 0 < float(diff.max()) < 0.05, key  # really bf16, within its tolerance
        bf16.optimizer_step()
        for p in bf16.handle.module.parameters():
            assert p.dtype == torch.float32  # master weights
        for state in bf16.handle.optimizer.state.values():
            assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
    finally:
        release_single_rank_group(group)
