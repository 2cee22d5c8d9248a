"""A tiny Mixtral-layout MoE model (built in code) in the megatron engine: log-probs and a
training step against plain transformers on the same weights, and router replay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from geartrain.config import EngineConfig, ModelConfig, OptimConfig
from geartrain.engine import Engine
from geartrain.testing.reference import reference_token_outputs, token_valid_mask
from transformers import MixtralConfig, MixtralForCausalLM

from .common import Receiver, make_batch, rank_context, reference_token_outputs_grad, run_ranks, token_mean_loss
from .moe_workers import expert_parallel_step, replay_run

LAYERS, EXPERTS, TOPK = 2, 4, 2


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = MixtralConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    with torch.no_grad():  # decisive routing: router logits of order 1, not 0.02
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    path = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(path)
    return path


def _engine(
    path: Path, *, lr: float = 1e-3, budget: int = 4096, checkpointing: bool = False, **options: object
) -> Engine:
    config = EngineConfig(
        backend="megatron",
        gradient_checkpointing=checkpointing,
        optim=OptimConfig(lr=lr, weight_decay=0.01, clip_grad=1.0),
        max_tokens_per_micro_batch=budget,
        options=dict(options),
    )
    return Engine(config, ModelConfig(path=str(path), tokenizer=None), rank_context(0, 1))


def _hf(path: Path) -> MixtralForCausalLM:
    return MixtralForCausalLM.from_pretrained(path, dtype=torch.float32).train()


def _hf_step(path: Path) -> dict[str, Any]:
    """Plain transformers: log-probs of ``make_batch(0)``, one AdamW step on
    ``make_batch(10)`` (loss, clipped grad norm), log-probs after it."""
    hf = _hf(path)
    batch = make_batch(0)
    out: dict[str, Any] = {"before": reference_token_outputs(hf.eval(), batch)["log_probs"]}
    hf.train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    train = make_batch(10)
    lp = reference_token_outputs_grad(hf, train)
    mask = train["loss_mask"].float()
    loss = -(lp * mask).sum() / mask.sum()
    loss.backward()
    out["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0))
    out["loss"] = loss.item()
    opt.step()
    out["after"] = reference_token_outputs(hf.eval(), batch)["log_probs"]
    return out


def test_moe_log_probs_and_a_step_match_transformers(mixtral_dir: Path) -> None:
    engine = _engine(mixtral_dir, budget=24)  # several micro-batches
    ref = _hf_step(mixtral_dir)
    batch = make_batch(0)
    valid = token_valid_mask(batch["attention_mask"])
    ours = engine.compute_log_probs(batch).outputs["log_probs"]
    torch.testing.assert_close(ours[valid], ref["before"][valid], atol=1e-5, rtol=0)
    out = engine.forward_backward(make_batch(10), token_mean_loss)
    stats = engine.optimizer_step()
    assert out.metrics["loss"] == pytest.approx(ref["loss"], abs=1e-5)
    assert stats["grad_norm"] == pytest.approx(ref["grad_norm"], abs=1e-5)
    after = engine.compute_log_probs(batch).outputs["log_probs"]
    torch.testing.assert_close(after[valid], ref["after"][valid], atol=1e-5, rtol=0)


def test_expert_parallel_2_matches_transformers(mixtral_dir: Path) -> None:
    """dp=2 with the experts split over the 2 ranks (megatron's all-to-all dispatcher over
    gloo, forward and backward): log-probs, a training step's loss and grad norm, and the
    log-probs after it equal plain transformers'."""
    ranks = run_ranks(expert_parallel_step, 2, str(mixtral_dir))
    assert sorted(tuple(r["experts"]) for r in ranks) == [(0, 1), (2, 3)]
    ref = _hf_step(mixtral_dir)
    by_dp = sorted(ranks, key=lambda r: r["dp"])
    valid = token_valid_mask(make_batch(0)["attention_mask"])
    for key in ("before", "after"):
        ours = torch.cat([r[key] for r in by_dp])
        torch.testing.assert_close(ours[valid], ref[key][valid], atol=1e-5, rtol=0)
    for r in ranks:  # the core sums the loss over DP ranks; the norm is global
        assert r["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], abs=1e-5)


def test_router_replay_reproduces_the_recorded_routing(mixtral_dir: Path) -> None:
    engine = _engine(mixtral_dir, lr=2e-2, router_replay=True)
    batch = make_batch(3, rows=8)
    first = engine.compute_log_probs(batch).outputs
    routed = first["routed_experts"]
    valid = batch["attention_mask"].bool()
    assert routed.shape == (len(batch), batch["input_ids"].shape[1], LAYERS, TOPK)
    assert (routed[valid].sort(-1).values[..., 0] != routed[valid].sort(-1).values[..., 1]).all()

    # replayed at the same weights, in a training forward/backward: exactly the first forward
    replayed = batch.clone()
    replayed["routed_experts"] = routed
    out = engine.forward_backward(replayed, token_mean_loss)
    assert torch.equal(out.outputs["log_probs"], first["log_probs"])
    assert "routed_experts" not in out.outputs  # replaying records nothing new

    # a small weight update between forwards: free routing changes, replayed routing holds
    engine.optimizer_step()
    free = engine.compute_log_probs(batch).outputs
    changed = (free["routed_experts"] != routed).any(-1).any(-1) & valid
    assert changed.any(), "the update moved no token to another expert: the case shows nothing"
    held = engine.compute_log_probs(replayed).outputs["log_probs"]
    # where free routing changed, the replayed log-probs differ from the free ones
    rows, cols = changed.nonzero(as_tuple=True)
    affected = torch.zeros_like(valid)
    for r, c in zip(rows.tolist(), cols.tolist(), strict=True):
        affected[r, c + 1 :] = valid[r, c + 1 :]  # later tokens attend to the re-routed one
    assert (held - free["log_probs"]).abs()[affected].max() > 1e-4
    assert torch.equal(held[~affected], free["log_probs"][~affected])


def test_moe_weights_round_trip_to_hf(mixtral_dir: Path, tmp_path: Path) -> None:
    """Rollout sync and ``export_hf`` rebuild HF's stacked expert tensors exactly; the export
    loads in plain transformers with the engine's log-probs."""
    engine = _engine(mixtral_dir)
    receiver = Receiver(bucket_bytes=4096)  # several buckets: experts straddle them
    stats = engine.sync_weights(receiver)
    hf = _hf(mixtral_dir)
    state = hf.state_dict()
    assert sorted(receiver.tensors) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(receiver.tensors[name], tensor), name
    assert stats.num_buckets > 1
    engine.forward_backward(make_batch(10), token_mean_loss)
    engine.optimizer_step()
    batch = make_batch(0)
    ours = engine.compute_log_probs(batch).outputs["log_probs"]
    # offload/onload of a MoE model (expert buffers, the chained dense+expert optimizer)
    off = engine.offload()
    assert off.detail["optimizer_released_bytes"] > 0 and off.detail["grads_released_bytes"] > 0
    engine.onload()
    assert torch.equal(engine.compute_log_probs(batch).outputs["log_probs"], ours)
    engine.export_hf(tmp_path / "hf", tokenizer=None)
    loaded = MixtralForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    valid = token_valid_mask(batch["attention_mask"])
    theirs = reference_token_outputs(loaded, batch)["log_probs"]
    torch.testing.assert_close(ours[valid], theirs[valid], atol=1e-5, rtol=0)


def test_router_replay_holds_in_the_activation_recompute(mixtral_dir: Path) -> None:
    """With gradient checkpointing the backward recomputes each layer's forward: the replayed
    routing must be used there too, so the gradients equal those of a run without recompute
    (several micro-batches: the recompute takes each one's routing in order)."""
    batch = make_batch(3, rows=8)
    engines = {
        gc: _engine(mixtral_dir, lr=2e-2, budget=40, checkpointing=gc, router_replay=True) for gc in (False, True)
    }
    routed = engines[False].compute_log_probs(batch).outputs["routed_experts"]
    for engine in engines.values():  # the same update on both: free routing now differs
        engine.forward_backward(make_batch(4, rows=8), token_mean_loss)
        engine.optimizer_step()
    assert (engines[False].compute_log_probs(batch).outputs["routed_experts"] != routed).any()
    replayed = batch.clone()
    replayed["routed_experts"] = routed
    grads = {}
    for gc, engine in engines.items():
        out = engine.forward_backward(replayed, token_mean_loss)
        assert out.metrics["micro_batches"] > 1
        grads[gc] = {n: p.main_grad.clone() for n, p in engine.handle.modules[0].named_parameters()}
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_router_replay_at_pp2_with_recompute_matches_one_rank(mixtral_dir: Path) -> None:
    """pp=2 (one MoE layer per stage), 1F1B over several micro-batches, gradient
    checkpointing: the recorded routing (gathered from both stages) equals one rank's, and a
    replayed training step gives one rank's log-probs, loss and grad norm."""
    ranks = run_ranks(replay_run, 2, str(mixtral_dir), 2, True)
    one = replay_run(0, 1, str(mixtral_dir), 1, False)  # in this process: one rank
    assert ranks[0]["micro_batches"] > 1
    for r in ranks:
        assert torch.equal(r["routed"], one["routed"])
        assert (r["free"] != r["routed"]).any()  # without replay the step's routing would differ
        torch.testing.assert_close(r["log_probs"], one["log_probs"], atol=1e-5, rtol=0)
        assert r["loss"] == pytest.approx(one["loss"], abs=1e-5)
        assert r["grad_norm"] == pytest.approx(one["grad_norm"], abs=1e-5)


def test_router_replay_options_are_validated(mixtral_dir: Path) -> None:
    engine = _engine(mixtral_dir, router_replay=True)
    bad = make_batch(0)
    bad["routed_experts"] = torch.zeros(len(bad), 3, LAYERS, TOPK, dtype=torch.long)
    with pytest.raises(ValueError, match="routed_experts"):
        engine.compute_log_probs(bad)
    from geartrain_megatron.modeling import check_supported
    from geartrain_megatron.parallel import Layout

    tp2 = Layout(tp=2, pp=1, vpp=None, dp=1, tp_rank=0, pp_rank=0, dp_rank=0, world=2)
    with pytest.raises(ValueError, match="parallel.tp=2: a MoE model needs megatron's sequence parallelism"):
        check_supported(MixtralConfig.from_pretrained(mixtral_dir), tp2)
    with pytest.raises(ValueError, match="router_replay"):
        Engine(
            EngineConfig(backend="megatron", options={"router_replay": True}),
            ModelConfig(tiny="llama", seed=1),
            rank_context(0, 1),
        )
