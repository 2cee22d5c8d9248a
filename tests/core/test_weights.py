"""geartrain.weights: bucket planning, lazy bucketing of a stream, and send_weights (the
whole reshard_for_rollout of a single-process engine) on a real tiny model."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch
from geartrain.modeling import tiny_model
from geartrain.weights import (
    UnknownTensorError,
    WeightCopy,
    bucketed,
    checked,
    plan_buckets,
    send_weights,
    tied_aliases,
    with_aliases,
)


def test_plan_buckets_keeps_order_and_the_bound() -> None:
    buckets = plan_buckets([("a", 4), ("b", 4), ("c", 10), ("d", 1), ("e", 1)], bucket_bytes=8)
    assert [(b.keys, b.nbytes) for b in buckets] == [(["a", "b"], 8), (["c"], 10), (["d", "e"], 2)]
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([("a", 1)], 0)


def test_bucketed_consumes_the_stream_lazily() -> None:
    pulled: list[str] = []

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(6):
            pulled.append(f"t{i}")
            yield f"t{i}", torch.zeros(2)  # 8 bytes each

    groups = bucketed(stream(), bucket_bytes=16)
    first = next(groups)
    assert [n for n, _ in first] == ["t0", "t1"]
    assert pulled == ["t0", "t1", "t2"], "only what decides the first bucket may be pulled"
    assert [[n for n, _ in g] for g in groups] == [["t2", "t3"], ["t4", "t5"]]


class Receiver:
    """A WeightReceiver keeping what it gets; ``stop_after`` stops consuming early."""

    def __init__(self, dtype: torch.dtype, bucket_bytes: int, stop_after: int | None = None) -> None:
        self.dtype, self.bucket_bytes, self.stop_after = dtype, bucket_bytes, stop_after
        self.got: dict[str, torch.Tensor] = {}

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_tensors:
            self.got[name] = tensor
            if self.stop_after is not None and len(self.got) >= self.stop_after:
                return


def test_send_weights_streams_every_tensor_in_the_receivers_dtype_and_bound() -> None:
    model = tiny_model("qwen2", seed=1)  # tied embeddings: one tensor under two names
    state = model.state_dict(keep_vars=True)
    receiver = Receiver(torch.bfloat16, bucket_bytes=20_000)
    gathered: list[int] = []

    def materialize(tensor: torch.Tensor) -> torch.Tensor:
        gathered.append(tensor.data_ptr())  # stands for a collective (FSDP's all-gather)
        return tensor

    stats = send_weights(state.items(), receiver, materialize=materialize)
    # every name, in order, except that the tied lm_head comes right after the embedding
    tied = ["model.embed_tokens.weight", "lm_head.weight"]
    assert list(receiver.got) == [tied[0], tied[1], *(n for n in state if n not in tied)]
    for name, tensor in receiver.got.items():
        assert tensor.dtype == torch.bfloat16
        torch.testing.assert_close(tensor, state[name].detach().to(torch.bfloat16), rtol=0, atol=0)
    assert receiver.got[tied[0]] is receiver.got[tied[1]]
    largest = max(t.numel() * 2 for t in state.values())
    assert stats.num_tensors == len(state) and stats.num_buckets > 2
    assert stats.max_bucket_bytes <= max(receiver.bucket_bytes, largest)
    # the tied tensor is planned once under both names (the model spans several buckets):
    # gathered once, counted once
    distinct = {t.data_ptr(): t for t in state.values()}
    assert sorted(gathered) == sorted(distinct) and len(distinct) == len(state) - 1
    assert stats.bytes == sum(t.numel() * 2 for t in distinct.values())


def test_sent_tensors_never_alias_the_live_parameters() -> None:
    model = tiny_model("llama", seed=2)
    receiver = Receiver(torch.float32, bucket_bytes=1 << 20)
    send_weights(model.state_dict(keep_vars=True).items(), receiver)
    before = receiver.got["model.norm.weight"].clone()
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    torch.testing.assert_close(receiver.got["model.norm.weight"], before, rtol=0, atol=0)


def test_what_the_receiver_leaves_is_still_gathered() -> None:
    model = tiny_model("llama", seed=0)
    entries = list(model.state_dict(keep_vars=True).items())
    gathered: list[int] = []

    def materialize(tensor: torch.Tensor) -> torch.Tensor:
        gathered.append(tensor.numel())  # stands for a collective every rank must join
        return tensor

    receiver = Receiver(torch.float32, bucket_bytes=4096, stop_after=3)
    stats = send_weights(entries, receiver, materialize=materialize)
    assert len(receiver.got) == 3
    assert len(gathered) == len(entries) and stats.num_tensors == len(entries)
    without = send_weights(entries, None, dtype=torch.float32, bucket_bytes=4096, materialize=materialize)
    assert without.num_tensors == len(entries) and without.num_buckets == stats.num_buckets


def test_receiving_side_names_unknown_tensors_and_fans_out_tied_ones() -> None:
    """A rollout's view of an incoming stream: a tied weight named under either of its names
    reaches both (qwen2 ties lm_head to the input embedding, llama does not), each name once,
    and the first name the model lacks is refused before anything after it is pulled."""
    tied = tied_aliases(tiny_model("qwen2", seed=0))
    assert tied == {"lm_head.weight": ("model.embed_tokens.weight",), "model.embed_tokens.weight": ("lm_head.weight",)}
    assert tied_aliases(tiny_model("llama", seed=0)) == {}
    embed, norm = torch.ones(2), torch.zeros(2)
    stream = [("lm_head.weight", embed), ("model.norm.weight", norm), ("model.embed_tokens.weight", embed)]
    assert [(n, t is embed) for n, t in with_aliases(stream, tied)] == [
        ("lm_head.weight", True),
        ("model.embed_tokens.weight", True),
        ("model.norm.weight", False),
    ]
    pulled: list[str] = []

    def source() -> Iterator[tuple[str, torch.Tensor]]:
        for name in ("a", "bogus", "b"):
            pulled.append(name)
            yield name, norm

    passed = []
    with pytest.raises(UnknownTensorError, match="bogus") as info:
        for name, _ in checked(source(), frozenset({"a", "b"})):
            passed.append(name)
    assert info.value.name == "bogus" and passed == ["a"] and pulled == ["a", "bogus"]


def test_model_directory_writes_what_an_engine_loads(tmp_path) -> None:  # noqa: ANN001
    """A tiny model's directory loads back as the same weights and tokenizer; a plain path
    is handed through untouched."""
    from geartrain.config import ModelConfig
    from geartrain.modeling import model_directory, pad_token_id, tiny_tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = ModelConfig(tiny="qwen2", seed=3)
    target = model_directory(config, tmp_path)
    assert target == tmp_path / "model"
    loaded = AutoModelForCausalLM.from_pretrained(target).state_dict()
    for name, tensor in tiny_model("qwen2", seed=3).state_dict().items():
        assert torch.equal(loaded[name], tensor), name
    assert AutoTokenizer.from_pretrained(target).get_vocab() == tiny_tokenizer().get_vocab()
    assert model_directory(ModelConfig(path="org/some-model"), tmp_path) == Path("org/some-model")
    assert pad_token_id(config) == tiny_tokenizer().pad_token_id and pad_token_id(config, 7) == 7


def test_weight_copy_merges_syncs_and_survives_a_spill(tmp_path: Path) -> None:
    """The host copy a released CPU engine restarts from: a partial sync updates only the
    tensors it names (in place), a spill frees the memory and leaves the values readable in
    arrival order, and a sync while spilled merges into them."""
    copy = WeightCopy(tmp_path / "w.safetensors")
    first = [("b", torch.ones(3)), ("a", torch.zeros(2))]
    assert [n for n, _ in copy.tee(iter(first))] == ["b", "a"]
    held = dict(copy.items())["b"]
    list(copy.tee(iter([("b", torch.full((3,), 2.0))])))
    assert dict(copy.items())["b"] is held and torch.equal(held, torch.full((3,), 2.0)), "updated in place"
    assert len(copy) == 2 and copy.nbytes == 5 * 4
    copy.spill()
    assert copy.spilled and copy.nbytes == 0 and (tmp_path / "w.safetensors").exists()
    assert [(n, t.tolist()) for n, t in copy.items()] == [("b", [2.0, 2.0, 2.0]), ("a", [0.0, 0.0])]
    list(copy.tee(iter([("a", torch.full((2,), 5.0))])))
    assert not copy.spilled and not (tmp_path / "w.safetensors").exists()
    assert [(n, t.tolist()) for n, t in copy.items()] == [("b", [2.0, 2.0, 2.0]), ("a", [5.0, 5.0])]
    # what the vLLM and SGLang rollouts report and do on a CPU release (kept, or spilled)
    assert copy.released(spill=False) == {"weight_copy_bytes": 5 * 4} and not copy.spilled
    assert copy.released(spill=True) == {"weight_copy_bytes": 5 * 4} and copy.spilled and copy.nbytes == 0
    copy.clear()
    assert len(copy) == 0 and list(copy.items()) == []
