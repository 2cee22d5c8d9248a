"""LoRA in the fsdp engine (PEFT): what only this engine can show — which parameters get
gradients and optimizer state, a bf16 base under fp32 adapters (one rank and two gloo
ranks), gradient checkpointing and shared-prompt packing, the adapter-only sync's size, the
PEFT / merged export, and the checkpoint's base fingerprint. The engine-independent LoRA
contract is in the conformance kit (``test_lora_*`` in test_conformance.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from geartrain.batch import Batch
from geartrain.checkpoint import CheckpointManager
from geartrain.config import EngineConfig, LoraConfig, ModelConfig, OptimConfig, ParallelConfig
from geartrain.engine import Engine
from geartrain.errors import CheckpointError, ConfigError
from geartrain.modeling import build_hf_model, tiny_tokenizer
from geartrain.testing.engine_suite import RecordingReceiver
from geartrain.testing.reference import reference_token_outputs

from .common import make_batch, rank_context, run_ranks, token_mean_loss


def lora_engine(
    *, rank: int = 8, sync: str = "merged", model: ModelConfig | None = None, world: int = 1, me: int = 0, **engine: Any
) -> Engine:
    config = EngineConfig(
        backend="fsdp",
        parallel=ParallelConfig(dp=world),
        optim=OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0),
        lora=LoraConfig(rank=rank, alpha=16, sync=sync, export_merged=True),  # type: ignore[arg-type]
        **engine,
    )
    return Engine(config, model or ModelConfig(tiny="qwen2", seed=3), rank_context(me, world))


def train(engine: Engine, steps: int, first_seed: int = 0, batch: Any = make_batch) -> list[float]:
    losses = []
    for step in range(steps):
        out = engine.forward_backward(batch(first_seed + step), token_mean_loss)
        engine.optimizer_step()
        losses.append(out.metrics["loss"])
    return losses


class AdapterReceiver(RecordingReceiver):
    """Keeps the weights and the adapter it is sent."""

    accepts_adapters = True

    def __init__(self) -> None:
        super().__init__()
        self.adapter: dict[str, torch.Tensor] = {}
        self.config: dict[str, Any] = {}

    def update_adapter(self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        self.adapter, self.config = dict(tensors), config


def test_only_the_adapters_get_gradients_and_optimizer_state() -> None:
    engine = lora_engine()
    handle = engine.handle
    trainable = {n for n, p in handle.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), sorted(trainable)[:4]
    train(engine, 1)
    engine.forward_backward(make_batch(5), token_mean_loss)  # gradients of the next step, not yet applied
    named = dict(handle.module.named_parameters())
    assert all(p.grad is None for n, p in named.items() if n not in trainable)
    assert all(p.grad is not None for n, p in named.items() if n in trainable)
    engine.optimizer_step()
    assert {id(p) for p in handle.optimizer.state} == {id(named[n]) for n in trainable}


def test_bf16_base_with_fp32_adapters_and_optimizer_state() -> None:
    engine = lora_engine(model=ModelConfig(tiny="qwen2", seed=3, dtype="bfloat16"))
    handle = engine.handle
    before = engine.compute_log_probs(make_batch(7)).outputs["log_probs"]
    losses = train(engine, 3)
    dtypes = {n: p.dtype for n, p in handle.module.named_parameters()}
    assert {d for n, d in dtypes.items() if ".lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if ".lora_" not in n} == {torch.bfloat16}
    moments = {t.dtype for state in handle.optimizer.state.values() for k, t in state.items() if k != "step"}
    assert moments == {torch.float32}
    assert all(torch.isfinite(torch.tensor(losses)))
    after = engine.compute_log_probs(make_batch(7)).outputs["log_probs"]
    assert (after - before).abs().max() > 1e-3


def _bf16_lora_rank(rank: int, world: int) -> dict[str, Any]:
    engine = lora_engine(model=ModelConfig(tiny="qwen2", seed=3, dtype="bfloat16"), world=world, me=rank)
    losses = train(engine, 2, batch=lambda seed: make_batch(seed).split(world)[rank])
    receiver = RecordingReceiver() if rank == 0 else None
    engine.sync_weights(receiver)
    return {"losses": losses, "weights": receiver.tensors if receiver is not None else None}


def test_bf16_base_under_fp32_adapters_on_two_gloo_ranks_matches_one_rank() -> None:
    """fp32 adapters over a bf16 base in the same FSDP2 groups (one per decoder layer), their
    initialisation the same on every rank: two data-parallel ranks train as one rank does."""
    two = run_ranks(_bf16_lora_rank, 2)
    one = run_ranks(_bf16_lora_rank, 1)[0]
    assert two[0]["losses"] == pytest.approx(one["losses"], abs=1e-5)  # global losses (summed over ranks)
    for name, tensor in one["weights"].items():
        torch.testing.assert_close(
            two[0]["weights"][name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )


def grpo_batch(seed: int) -> Batch:
    """4 prompts x 3 samples, the layout a GRPO step trains on (shared prompts)."""
    base = make_batch(seed, rows=4)
    rows = [r for r in range(4) for _ in range(3)]
    batch = base.index(rows)
    g = torch.Generator().manual_seed(seed + 100)
    resp = batch["loss_mask"].bool()
    batch["input_ids"][resp] = torch.randint(4, 128, (int(resp.sum()),), generator=g)
    return batch


def test_gradient_checkpointing_and_shared_prompt_packing_keep_the_lora_step() -> None:
    plain = lora_engine(options={"share_prompt_prefix": False})
    fancy = lora_engine(gradient_checkpointing=True, options={"share_prompt_prefix": True})
    assert train(plain, 3, batch=grpo_batch) == pytest.approx(train(fancy, 3, batch=grpo_batch), abs=1e-5)
    a, b = RecordingReceiver(), RecordingReceiver()
    plain.sync_weights(a)
    fancy.sync_weights(b)
    for name in a.tensors:
        torch.testing.assert_close(a.tensors[name], b.tensors[name], atol=1e-5, rtol=0)


def test_adapter_only_sync_of_rank_16_moves_under_5_percent_of_a_full_sync() -> None:
    """On a model with 1024-wide layers (the ratio is r (in + out) / (in x out) per layer, so
    it needs realistic widths; the tiny 128-wide model's rank-16 adapter is ~20 %)."""
    model = ModelConfig(
        tiny="qwen2",
        seed=1,
        config_overrides={
            "hidden_size": 1024,
            "intermediate_size": 2816,
            "num_hidden_layers": 1,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
        },
    )
    engine = lora_engine(rank=16, sync="adapter", model=model)
    receiver = AdapterReceiver()
    first = engine.sync_weights(receiver)  # the base once, then the adapter
    second = engine.sync_weights(receiver)
    full = engine.sync_weights(RecordingReceiver())  # no adapters taken: the merged weights
    assert second.bytes == sum(t.numel() * t.element_size() for t in receiver.adapter.values())
    assert first.bytes == full.bytes + second.bytes
    assert second.bytes <= 0.05 * full.bytes, f"{second.bytes / full.bytes:.3%}"
    assert receiver.config["r"] == 16 and receiver.config["lora_alpha"] == 16


@pytest.mark.parametrize("bucket_bytes", [1 << 30, 1 << 14])
def test_merged_sync_moves_the_bytes_of_a_full_sync_of_the_same_model(bucket_bytes: int) -> None:
    """The tiny model ties its output layer to the embedding: the merged sync materialises
    (and counts) it once, as the plain engine's full sync does, whether the model fits one
    bucket or spans many (the tied names are planned into one bucket), and sends the same
    tensors (the adapter is zero-initialised: merged = base)."""
    merged, full = RecordingReceiver(bucket_bytes=bucket_bytes), RecordingReceiver(bucket_bytes=bucket_bytes)
    lora = lora_engine().sync_weights(merged)
    plain_engine = Engine(EngineConfig(backend="fsdp"), ModelConfig(tiny="qwen2", seed=3), rank_context(0, 1))
    plain = plain_engine.sync_weights(full)
    whole = plain_engine.sync_weights(RecordingReceiver(bucket_bytes=1 << 30))  # the reference: one bucket
    assert whole.num_buckets == 1 and (plain.num_buckets > 10 or bucket_bytes == 1 << 30), plain
    assert lora.bytes == plain.bytes == whole.bytes
    assert merged.tensors.keys() == full.tensors.keys()
    for name, tensor in full.tensors.items():
        torch.testing.assert_close(merged.tensors[name], tensor, atol=0, rtol=0)


def test_export_writes_a_peft_adapter_and_the_merged_model(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    engine = lora_engine()
    train(engine, 2)
    engine.export_hf(tmp_path / "hf", tokenizer=tiny_tokenizer())
    batch = make_batch(9)
    ours = engine.compute_log_probs(batch).outputs["log_probs"]
    peft_model = PeftModel.from_pretrained(build_hf_model(engine.model_config), tmp_path / "hf").eval()
    torch.testing.assert_close(reference_token_outputs(peft_model, batch)["log_probs"], ours, atol=1e-5, rtol=0)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "merged", dtype=torch.float32).eval()
    torch.testing.assert_close(reference_token_outputs(merged, batch)["log_probs"], ours, atol=1e-5, rtol=0)
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def test_checkpoint_refuses_a_changed_base_and_a_full_model(tmp_path: Path) -> None:
    saved = lora_engine()
    train(saved, 1)
    path = saved.save_checkpoint(CheckpointManager(tmp_path / "ck", keep_last=1), 1, {})
    other_base = lora_engine(model=ModelConfig(tiny="qwen2", seed=4))
    with pytest.raises(CheckpointError, match="the base model changed"):
        other_base.load_checkpoint(path)
    full = Engine(EngineConfig(backend="fsdp"), ModelConfig(tiny="qwen2", seed=3), rank_context(0, 1))
    with pytest.raises(CheckpointError, match="holds LoRA adapters only"):
        full.load_checkpoint(path)


def test_checkpoint_holds_the_adapters_and_their_adam_moments_only(tmp_path: Path) -> None:
    """The frozen base stays out, the tied output layer (qwen2 ties it to the embedding) too."""
    import torch.distributed.checkpoint as dcp

    engine = lora_engine()
    train(engine, 1)
    path = engine.save_checkpoint(CheckpointManager(tmp_path / "ck", keep_last=1), 1, {})
    saved = dcp.FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata
    weights = {k for k in saved if k.startswith("model.")}
    adapters = {n for n, p in engine.handle.module.named_parameters() if p.requires_grad}
    assert weights == {f"model.{n}" for n in adapters}
    moments = {k.rsplit(".", 1)[-1] for k in saved if k.startswith("optim.state.")}
    assert moments == {"exp_avg", "exp_avg_sq", "step"}


def test_lora_on_a_value_model_is_refused() -> None:
    with pytest.raises(ConfigError, match="not a value model"):
        lora_engine(model=ModelConfig(tiny="qwen2", value_head=True))


def test_adapters_off_without_adapters_is_a_clear_error() -> None:
    engine = Engine(EngineConfig(backend="fsdp"), ModelConfig(tiny="qwen2"), rank_context(0, 1))
    with pytest.raises(Exception, match="has no LoRA adapters to turn off"):
        engine.compute_log_probs(make_batch(0), adapters_off=True)
