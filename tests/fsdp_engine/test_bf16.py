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

    def spy(hidden, weight, targets, *flags):  # noqa: ANN001, ANN002, ANN202
        seen.append((hidden.dtype, weight.dtype, hidden.shape[0]))
        return real(hidden, weight, targets, *flags)

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


def test_one_rank_bf16_computes_in_bf16_end_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 33 item 4: a one-rank bf16 engine with its process group (as every training job
    has) shards over a one-rank mesh without cpu_offload, so every tensor reaching a decoder
    layer, its matmuls and its attention is bf16 (under autocast the residual stream, the
    norms' outputs and the rotated q/k were fp32), over fp32 master weights and AdamW state."""
    from geartrain_fsdp.ulysses import ATTENTION_NAME
    from transformers import AttentionInterface

    seen: dict[str, set[torch.dtype]] = {"layer": set(), "linear": set(), "attention": set()}
    real = AttentionInterface._global_mapping[ATTENTION_NAME]

    def attention(module, query, key, value, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen["attention"].update({query.dtype, key.dtype, value.dtype})
        return real(module, query, key, value, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, ATTENTION_NAME, attention)
    group = acquire_single_rank_group("cpu")
    try:
        cfg = EngineConfig(**{**engine_config(budget=10_000).model_dump(), "param_dtype": "bfloat16"})
        engine = Engine(cfg, ModelConfig(tiny="qwen2"), EngineContext(role="actor", process_group=group))
        assert engine.handle.meshes.distributed
        hf = engine.handle.hf

        def layer_input(_m, args, kwargs):  # noqa: ANN001, ANN202
            seen["layer"].add((args[0] if args else kwargs["hidden_states"]).dtype)

        for layer in hf.model.layers:
            layer.register_forward_pre_hook(layer_input, with_kwargs=True)
            for linear in (m for m in layer.modules() if isinstance(m, torch.nn.Linear)):
                linear.register_forward_pre_hook(lambda m, args: seen["linear"].update({args[0].dtype, m.weight.dtype}))
        out = engine.forward_backward(make_batch(5, rows=6), token_mean_loss)
        assert seen == {"layer": {torch.bfloat16}, "linear": {torch.bfloat16}, "attention": {torch.bfloat16}}
        assert out.outputs["log_probs"].dtype == torch.float32
        engine.optimizer_step()
        assert all(p.dtype == torch.float32 for p in engine.handle.module.parameters())
        for state in engine.handle.optimizer.state.values():
            assert state["exp_avg"].dtype == torch.float32
    finally:
        release_single_rank_group(group)
