"""Single-process checks of the fsdp engine: packed vs padded micro-batches, token-budget
invariance, chunked log-probs, value models, LR schedules, skipped steps, offload."""

from __future__ import annotations

import math

import pytest
import torch
from geartrain.config import OptimConfig
from geartrain.micro_batches import plan_micro_batches
from geartrain.optim import lr_factor
from geartrain.testing import tiny_model
from geartrain_fsdp.logprobs import token_log_probs
from geartrain_fsdp.packing import pack, scatter_shifted

from .common import full_grads, full_params, make_batch, make_engine, reference_outputs, token_mean_loss, value_loss


def _step(engine, batch, loss_fn=token_mean_loss):
    res = engine.forward_backward(batch, loss_fn)
    return res, full_grads(engine)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_packed_equals_padded(family: str) -> None:
    batch = make_batch(1, rows=7)
    packed = make_engine(family, budget=30)
    padded = make_engine(family, budget=30, options={"remove_padding": False})
    a, ga = _step(packed, batch)
    b, gb = _step(padded, batch)
    assert torch.allclose(a.outputs["log_probs"], b.outputs["log_probs"], atol=1e-5, rtol=0)
    assert a.metrics["loss"] == pytest.approx(b.metrics["loss"], abs=1e-6)
    for name in ga:
        assert torch.allclose(ga[name], gb[name], atol=1e-6, rtol=1e-4), name
    ref = reference_outputs(tiny_model(family), batch)
    assert torch.allclose(b.outputs["log_probs"], ref["log_probs"].detach(), atol=1e-5, rtol=0)


def test_hook_forward_backward_micro_batch_budget_does_not_change_results() -> None:
    batch = make_batch(2, rows=8)
    one, g1 = _step(make_engine(budget=10_000), batch)
    many, g2 = _step(make_engine(budget=12), batch)
    assert one.metrics["micro_batches"] == 1 and many.metrics["micro_batches"] >= 6
    assert torch.allclose(one.outputs["log_probs"], many.outputs["log_probs"], atol=1e-6, rtol=0)
    assert one.metrics["loss"] == pytest.approx(many.metrics["loss"], abs=1e-6)
    assert one.metrics["tokens"] == float(batch["attention_mask"].sum())
    for name in g1:
        assert torch.allclose(g1[name], g2[name], atol=1e-6, rtol=1e-5), name


def test_chunked_log_probs_and_entropy_match_full_logits() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    out = token_log_probs(hidden, weight, targets, chunk_tokens=8, need_entropy=True, need_sum_pi_squared=True)
    lp, ent = out["log_probs"], out["entropy"]
    (lp.sum() + 0.3 * ent.sum()).backward()
    g = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logits = hidden @ weight.t()
    full = torch.log_softmax(logits, -1)
    lp_ref = full.gather(-1, targets[:, None]).squeeze(-1)
    ent_ref = -(full.exp() * full).sum(-1)
    (lp_ref.sum() + 0.3 * ent_ref.sum()).backward()
    assert torch.allclose(lp, lp_ref, atol=1e-5) and torch.allclose(ent, ent_ref, atol=1e-5)
    assert torch.allclose(g[0], hidden.grad, atol=1e-5) and torch.allclose(g[1], weight.grad, atol=1e-5)
    # Σπ² from the full distribution (chunks of 8 of the 37 tokens; no gradient)
    spp_ref = (full.exp() ** 2).sum(-1)
    assert not out["sum_pi_squared"].requires_grad
    torch.testing.assert_close(out["sum_pi_squared"], spp_ref.detach(), atol=1e-5, rtol=0)


def test_engine_chunked_vocab_matches_unchunked() -> None:
    batch = make_batch(4)
    batch.info["need_entropy"] = True
    a, ga = _step(make_engine(options={"logits_chunk_tokens": 5}), batch)
    b, gb = _step(make_engine(), batch)
    for key in ("log_probs",):
        assert torch.allclose(a.outputs[key], b.outputs[key], atol=1e-6, rtol=0)
    for name in ga:
        assert torch.allclose(ga[name], gb[name], atol=1e-6, rtol=1e-5), name
    ent = make_engine(options={"logits_chunk_tokens": 5}).compute_log_probs(batch, entropy=True).outputs["entropy"]
    ref = reference_outputs(tiny_model("qwen2"), batch)["entropy"].detach()
    assert torch.allclose(ent, ref, atol=1e-5, rtol=0)


def test_hook_build_model_value_head_outputs_per_token_values() -> None:
    from geartrain.testing import tiny_config
    from transformers import AutoModelForTokenClassification

    batch = make_batch(5)
    engine = make_engine(value_head=True, budget=20)
    res = engine.forward_backward(batch, value_loss)
    values = res.outputs["values"]
    # reference: the token-classification model's score at position t-1, in eval mode (no dropout)
    cfg = tiny_config("qwen2")
    cfg.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ref_model = AutoModelForTokenClassification.from_config(cfg, attn_implementation="sdpa").eval()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        score = ref_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[..., 0]
    keep = (mask[:, 1:] * mask[:, :-1]).bool()
    expected = torch.cat([torch.zeros(len(batch), 1), torch.where(keep, score[:, :-1], 0.0)], 1)
    assert torch.allclose(values, expected, atol=1e-5, rtol=0)
    assert "vloss" in res.metrics and engine.optimizer_step()["skipped"] == 0.0


def test_hook_shard_tells_a_value_model_from_a_policy() -> None:
    """``shard`` learns the kind of model from the ModelConfig it is given (not by guessing
    from the module): a value model answers with ``values``, a policy with ``log_probs``."""
    policy, critic = make_engine(), make_engine(value_head=True)
    assert (policy.handle.value_head, critic.handle.value_head) == (False, True)
    batch = make_batch(3)
    assert set(policy.compute_log_probs(batch).outputs) == {"log_probs"}
    assert set(critic.compute_log_probs(batch).outputs) == {"values"}


def test_lr_schedules() -> None:
    cos = OptimConfig(lr=1.0, lr_schedule="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    assert [lr_factor(s, cos) for s in range(2)] == [0.5, 1.0]
    assert lr_factor(2, cos) == pytest.approx(1.0)
    assert lr_factor(4, cos) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(6, cos) == pytest.approx(0.1) and lr_factor(9, cos) == pytest.approx(0.1)
    lin = OptimConfig(lr=1.0, lr_schedule="linear", total_steps=4)
    assert [lr_factor(s, lin) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    engine = make_engine(lr=0.1, lr_schedule="linear", total_steps=4)
    lrs = []
    for _ in range(3):
        engine.forward_backward(make_batch(0), token_mean_loss)
        lrs.append(engine.optimizer_step()["lr"])
    assert lrs == pytest.approx([0.1, 0.075, 0.05])


def test_hook_optimizer_step_non_finite_grad_norm_skips_the_step() -> None:
    engine = make_engine()
    before = full_params(engine)

    def nan_loss(outputs, mb, ctx):
        share, metrics = token_mean_loss(outputs, mb, ctx)
        return share * float("nan"), metrics

    engine.forward_backward(make_batch(0), nan_loss)
    out = engine.optimizer_step()
    assert out["skipped"] == 1.0 and not math.isfinite(out["grad_norm"])
    after = full_params(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in engine.handle.module.parameters())
    engine.forward_backward(make_batch(0), token_mean_loss)
    ok = engine.optimizer_step()
    assert ok["skipped"] == 0.0 and ok["lr"] == pytest.approx(engine.config.optim.lr)


def test_hook_onload_keeps_training_identical_after_offload() -> None:
    a, b = make_engine(), make_engine()
    batch = make_batch(6)
    for engine in (a, b):
        engine.forward_backward(batch, token_mean_loss)
        engine.optimizer_step()
    stats = a.offload()
    assert stats.detail["params_bytes"] > 0 and stats.detail["optimizer_bytes"] > 0
    assert stats.before > 0 and stats.after > 0
    a.onload()
    for engine in (a, b):
        engine.forward_backward(batch, token_mean_loss)
        engine.optimizer_step()
    pa, pb = full_params(a), full_params(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_hook_offload_reports_what_it_moved() -> None:
    engine = make_engine()
    engine.forward_backward(make_batch(6), token_mean_loss)
    engine.optimizer_step()
    stats = engine.offload(frozenset({"params", "optimizer"}))
    tensors = list(engine.handle.module.parameters())
    params = sum(p.numel() * p.element_size() for p in tensors)
    assert stats.detail["params_bytes"] == params
    # AdamW: two moments per weight and one float32 step count per tensor
    assert stats.detail["optimizer_bytes"] == 2 * params + 4 * len(tensors)
    engine.onload()
    with pytest.raises(ValueError, match="cannot offload"):
        engine.offload(frozenset({"kv_cache"}))


def test_hook_export_hf_writes_what_transformers_loads(tmp_path) -> None:  # noqa: ANN001
    from geartrain.testing import tiny_tokenizer
    from transformers import AutoModelForCausalLM

    engine = make_engine()
    engine.forward_backward(make_batch(2), token_mean_loss)
    engine.optimizer_step()
    engine.export_hf(tmp_path / "hf", tiny_tokenizer())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
    trained = full_params(engine)
    assert set(loaded) == set(trained)
    assert all(torch.equal(loaded[k], trained[k]) for k in trained)


def test_plan_and_pack_roundtrip() -> None:
    plan = plan_micro_batches([5, 9, 3, 7, 1], budget=10)
    assert sorted(i for g in plan for i in g) == [0, 1, 2, 3, 4]
    assert all(sum([5, 9, 3, 7, 1][i] for i in g) <= 10 for g in plan)
    assert len(plan_micro_batches([5, 9], budget=100, min_count=4)) == 4  # empty filler groups
    batch = make_batch(8, rows=4)
    p = pack(batch["input_ids"], batch["attention_mask"], multiple=4)
    assert p.input_ids.shape[1] % 4 == 0 and p.num_tokens == int(batch["attention_mask"].sum())
    # scattering the packed "next token" targets reproduces the input ids where log-probs live
    back = scatter_shifted(p.targets.float(), p).long()
    keep = batch["attention_mask"].bool() & (batch["attention_mask"].cumsum(1) > 1)
    assert torch.equal(back[keep], batch["input_ids"][keep]) and (back[~keep] == 0).all()


def test_bf16_compute_stays_close_to_fp32() -> None:
    """``param_dtype = bfloat16``: compute in bf16 (autocast in one process, FSDP's
    MixedPrecisionPolicy on several ranks) with fp32 master weights."""
    from geartrain.config import EngineConfig, ModelConfig
    from geartrain.engine import Engine
    from geartrain.types import EngineContext

    from .common import engine_config

    cfg = engine_config()
    bf16 = Engine(
        EngineConfig(**{**cfg.model_dump(), "param_dtype": "bfloat16"}),
        ModelConfig(tiny="qwen2"),
        EngineContext(role="actor"),
    )
    fp32 = make_engine()
    batch = make_batch(3)
    a = bf16.forward_backward(batch, token_mean_loss)
    b = fp32.forward_backward(batch, token_mean_loss)
    mask = batch["attention_mask"].bool()
    assert not torch.equal(a.outputs["log_probs"], b.outputs["log_probs"])  # it really ran in bf16
    assert torch.allclose(a.outputs["log_probs"][mask], b.outputs["log_probs"][mask], atol=0.05)
    assert all(p.dtype == torch.float32 for p in bf16.handle.module.parameters())
    assert bf16.optimizer_step()["skipped"] == 0.0


def test_length_grouped_attention_is_bitwise_one_call_per_sequence() -> None:
    """Short ragged sequences (the main job's: 7-12 tokens) run one SDPA call per distinct
    length; every number equals one causal call per sequence, forward and backward."""
    from geartrain_fsdp.ulysses import PackedAttentionState, varlen_causal_attention

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(7, 13, (40,), generator=g).tolist()
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    q = torch.randn(1, 4, cu[-1], 8, generator=g, requires_grad=True)
    k = torch.randn(1, 2, cu[-1], 8, generator=g, requires_grad=True)
    v = torch.randn(1, 2, cu[-1], 8, generator=g, requires_grad=True)
    out_grad = torch.randn(1, 4, cu[-1], 8, generator=g)

    def one_call_each() -> torch.Tensor:
        outs = [
            torch.nn.functional.scaled_dot_product_attention(
                q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, scale=0.3, enable_gqa=True
            )
            for s, e in zip(cu[:-1], cu[1:], strict=True)
        ]
        return torch.cat(outs, dim=2)

    def compare(*, bitwise: bool) -> None:
        state = PackedAttentionState(cu_seqlens=cu)
        grouped = varlen_causal_attention(q, k, v, cu, 0.3, state)
        assert state.groups is not None and len(state.groups.groups) == len(set(lengths))  # it really grouped
        want = one_call_each()
        got_grads = torch.autograd.grad(grouped, (q, k, v), out_grad)
        want_grads = torch.autograd.grad(want, (q, k, v), out_grad)
        for got, ref in zip((grouped, *got_grads), (want, *want_grads), strict=True):
            if bitwise:
                assert torch.equal(got, ref)
            else:
                torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)

    # Bit-for-bit only with one intra-op thread: with more, the batched call's GEMMs are
    # blocked differently from the per-sequence ones and round differently (~1e-7).
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        compare(bitwise=True)
    finally:
        torch.set_num_threads(threads)
    compare(bitwise=False)
