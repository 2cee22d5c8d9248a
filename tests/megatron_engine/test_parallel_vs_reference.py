"""megatron's tensor, pipeline (plain and interleaved) and data parallelism on 2 gloo ranks
(and TP2 x PP2 on 4) against
one plain transformers process on the same HF weights and batches: per-token log-probs and
entropy, losses and grad norms of two AdamW steps, the weights streamed out afterwards, and
a checkpoint saved at TP2 loaded at PP2 x VPP2 and at TP1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from geartrain.checkpoint import CheckpointManager
from geartrain.testing.reference import token_valid_mask

from .common import make_batch, make_engine, reference, run_ranks
from .workers import train_and_sync


def _check_against_reference(ranks: list[dict], family: str, *, lp_atol: float) -> None:
    ref = reference(family)
    batch = make_batch(0)
    valid = token_valid_mask(batch["attention_mask"])
    size = ranks[0]["dp"][1]
    by_dp = {r["dp"][0]: r for r in ranks}
    forward = {k: torch.cat([by_dp[i]["forward"][k] for i in range(size)]) for k in ("log_probs", "entropy")}
    for r in ranks:  # every rank of a replica returns the same outputs
        mine = by_dp[r["dp"][0]]["forward"]
        assert torch.equal(r["forward"]["log_probs"], mine["log_probs"])
    torch.testing.assert_close(forward["log_probs"][valid], ref["forward"]["log_probs"][valid], atol=lp_atol, rtol=0)
    torch.testing.assert_close(forward["entropy"][valid], ref["forward"]["entropy"][valid], atol=10 * lp_atol, rtol=0)
    assert torch.all(forward["log_probs"][~valid] == 0)
    for r in ranks:
        assert r["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], abs=1e-5)
        names = set(r["weights"])
        assert names <= set(ref["weights"]) and {n for n in ref["weights"] if n != "lm_head.weight"} <= names
        for name, tensor in r["weights"].items():
            torch.testing.assert_close(
                tensor, ref["weights"][name], atol=1e-4, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
            )


@pytest.mark.slow
def test_tp2_then_pp2_vpp2_and_tp1_from_its_checkpoint(tmp_path: Path) -> None:
    """qwen2 (GQA, QKV bias, tied embeddings): TP2 trains and saves; PP2 x VPP2 (the tied
    embedding split across the first and last stage) trains from scratch, then loads the
    TP2 checkpoint; one rank (TP1) loads it too."""
    ckpt = tmp_path / "ckpt"
    tp = run_ranks(train_and_sync, 2, "qwen2", {"tp": 2}, 4096, str(ckpt), None)
    _check_against_reference(tp, "qwen2", lp_atol=1e-5)
    assert tp[0]["micro_batches"][0] == 1

    # 12 tokens per micro-batch: several micro-batches, a multiple of pp for interleaving
    pp = run_ranks(train_and_sync, 2, "qwen2", {"pp": 2, "vpp": 2}, 12, None, str(ckpt))
    _check_against_reference(pp, "qwen2", lp_atol=1e-5)
    assert pp[0]["micro_batches"][0] > 2 and pp[0]["micro_batches"][0] % 2 == 0
    for r in pp:
        assert r["loaded_extra"] == {"saved": {"tp": 2}}
        torch.testing.assert_close(r["probe"], tp[0]["probe"], atol=1e-6, rtol=0)
        for name, tensor in tp[0]["weights"].items():
            assert torch.equal(r["loaded_weights"][name], tensor), name

    one = make_engine("qwen2", 0, 1)
    extra = one.load_checkpoint(CheckpointManager(ckpt).latest())
    assert extra == {"saved": {"tp": 2}}
    probe = one.compute_log_probs(make_batch(7)).outputs["log_probs"]
    torch.testing.assert_close(probe, tp[0]["probe"], atol=1e-6, rtol=0)


@pytest.mark.slow
def test_plain_pp2_1f1b() -> None:
    """qwen2 on two pipeline stages without virtual stages (megatron's non-interleaved 1F1B):
    the tied embedding lives on the first and the last stage, several micro-batches."""
    ranks = run_ranks(train_and_sync, 2, "qwen2", {"pp": 2}, 12, None, None)
    assert sorted(r["dp"] for r in ranks) == [(0, 1), (0, 1)]
    assert ranks[0]["micro_batches"][0] > 2
    _check_against_reference(ranks, "qwen2", lp_atol=1e-5)


@pytest.mark.slow
def test_llama_tp2_pp2_on_four_ranks() -> None:
    """llama (untied output layer) on 4 ranks: two pipeline stages of two tensor-parallel
    ranks each; the output layer's vocabulary is split across the last stage's TP pair."""
    ranks = run_ranks(train_and_sync, 4, "llama", {"tp": 2, "pp": 2}, 20, None, None)
    assert [r["dp"] for r in ranks] == [(0, 1)] * 4
    _check_against_reference(ranks, "llama", lp_atol=1e-5)


@pytest.mark.slow
def test_llama_dp2_distributed_optimizer() -> None:
    """llama (untied output layer, MHA) on 2 data-parallel ranks with megatron's distributed
    optimizer: each rank consumes its slice and the step equals the one-process step."""
    ranks = run_ranks(
        train_and_sync, 2, "llama", {"dp": 2, "options": {"use_distributed_optimizer": True}}, 20, None, None
    )
    assert sorted(r["dp"] for r in ranks) == [(0, 2), (1, 2)]
    _check_against_reference(ranks, "llama", lp_atol=1e-5)


def test_empty_batch_slice_returns_empty_outputs() -> None:
    engine = make_engine("qwen2", 0, 1)
    batch = make_batch(0)
    empty = batch.index(slice(0, 0))
    out = engine.compute_log_probs(empty)
    assert out.outputs["log_probs"].shape == (0, batch["input_ids"].shape[1])
