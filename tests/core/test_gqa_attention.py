"""The torch rollout's GQA-native decode attention (:mod:`geartrain.rollouts.gqa_attention`):
the same numbers as transformers' ``sdpa`` path, without expanding the KV cache."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from geartrain import EngineContext, ModelConfig, Rollout, RolloutConfig, SamplingParams
from geartrain.rollouts.gqa_attention import GQA_DECODE, gqa_decode_attention, kv_bucket, use_gqa_decode
from geartrain.testing import tiny_model
from geartrain.testing.rollout_suite import encode_prompts
from transformers.integrations.sdpa_attention import sdpa_attention_forward


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Grouped(torch.nn.Module):
    """The attributes transformers' sdpa function reads from an attention module."""

    def __init__(self, group: int) -> None:
        super().__init__()
        self.num_key_value_groups = group
        self.is_causal = True


@pytest.mark.parametrize(("heads", "kv_heads"), [(14, 2), (4, 2), (8, 1)])
@pytest.mark.parametrize("masked", [True, False])
def test_decode_attention_equals_transformers_sdpa(heads: int, kv_heads: int, masked: bool) -> None:
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    batch, length, dim = 5, 37, 16
    query = torch.randn(batch, heads, 1, dim, generator=gen)
    key = torch.randn(batch, kv_heads, length, dim, generator=gen)
    value = torch.randn(batch, kv_heads, length, dim, generator=gen)
    mask = None
    if masked:  # left padding and unfilled static-cache columns, as a decode step has them
        keep = torch.ones(batch, length, dtype=torch.bool)
        keep[0, :7] = False
        keep[2, :3] = False
        keep[:, 30:] = False
        mask = keep[:, None, None, :]
    module = _Grouped(heads // kv_heads)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim**-0.5)
    got, _ = gqa_decode_attention(module, query, key, value, mask, scaling=dim**-0.5)
    assert got.shape == want.shape == (batch, 1, heads, dim)
    err = float((got - want).abs().max())
    assert err < 2e-6, err


def test_prefill_goes_to_transformers_sdpa() -> None:
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 6, 8, generator=gen)
    key, value = torch.randn(2, 2, 6, 8, generator=gen), torch.randn(2, 2, 6, 8, generator=gen)
    module = _Grouped(2)
    want, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.3)
    got, _ = gqa_decode_attention(module, query, key, value, None, scaling=0.3)
    assert torch.equal(got, want)


def test_only_grouped_sdpa_models_switch() -> None:
    grouped, full = tiny_model("qwen2"), tiny_model("llama")  # 4 heads / 2 kv heads; 4 / 4
    assert use_gqa_decode(grouped)
    assert grouped.config._attn_implementation == GQA_DECODE
    assert not use_gqa_decode(full)
    assert full.config._attn_implementation == "sdpa"


def _rollout(decode_attention: str, static: bool) -> Rollout:
    return Rollout(
        RolloutConfig(
            backend="torch",
            max_model_len=64,
            options={"static_cache": static, "decode_attention": decode_attention},
        ),
        ModelConfig(tiny="qwen2", seed=0),
        EngineContext(role="rollout"),
    )


@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
def test_rollout_decodes_without_expanding_the_cache(static: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same tokens and log-probs as transformers' path, and every single-token SDPA call of
    the default rollout reads the keys with the model's 2 kv heads, not 4 expanded ones."""
    sampling = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=3)
    prompts = encode_prompts()[:3]
    hf = _rollout("hf", static)
    try:
        want = hf.generate(prompts, sampling)
    finally:
        hf.shutdown()
    key_heads: list[int] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(query: torch.Tensor, key: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if query.shape[1] * query.shape[2] == 4:  # one token's 4 query heads: a decode step
            key_heads.append(key.shape[1])
        return real(query, key, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    gqa = _rollout("gqa", static)
    try:
        got = gqa.generate(prompts, sampling)
    finally:
        gqa.shutdown()
    assert key_heads and set(key_heads) == {2}
    assert torch.equal(got["input_ids"], want["input_ids"])
    err = float((got["rollout_log_probs"] - want["rollout_log_probs"]).abs().max())
    assert err < 1e-5, err


def test_kv_bucket_rounds_up_within_the_width() -> None:
    assert [kv_bucket(n, 4, 14) for n in (1, 4, 5, 8, 12, 13, 14)] == [4, 4, 8, 8, 12, 14, 14]


def _bounded_rollout(bucket: int) -> Rollout:
    return Rollout(
        RolloutConfig(backend="torch", max_model_len=64, options={"static_cache": True, "kv_bucket_tokens": bucket}),
        ModelConfig(tiny="qwen2", seed=0),
        EngineContext(role="rollout"),
    )


def _decode_key_lengths(bucket: int, monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], Any]:
    lengths: list[int] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(query: torch.Tensor, key: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if query.shape[1] * query.shape[2] == 4:  # a decode step
            lengths.append(key.shape[2])
        return real(query, key, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    rollout = _bounded_rollout(bucket)
    try:
        batch = rollout.generate(encode_prompts()[:3], SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=5))
    finally:
        rollout.shutdown()
        monkeypatch.undo()
    return lengths, batch


def test_static_decode_reads_only_the_filled_cache_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 33 item 3: with kv_bucket_tokens = 4 a decode step reads the filled columns
    rounded up to 4, not the cache's whole width; same tokens and log-probs."""
    whole, want = _decode_key_lengths(0, monkeypatch)
    bounded, got = _decode_key_lengths(4, monkeypatch)
    width = whole[0]
    assert set(whole) == {width}
    assert len(bounded) == len(whole) and min(bounded) < width and max(bounded) <= width
    assert all(n % 4 == 0 or n == width for n in bounded)
    assert bounded == sorted(bounded)  # grows with the filled part
    assert torch.equal(got["input_ids"], want["input_ids"])
    err = float((got["rollout_log_probs"] - want["rollout_log_probs"]).abs().max())
    assert err < 1e-5, err


def test_the_step_graph_loop_captures_one_step_per_key_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_graph = "step" with buckets: a captured step is replayed only at steps of its
    own key length (a CUDA graph has it baked in); a new bucket is captured once."""
    from geartrain.rollouts import static_decode

    captured: list[int | None] = []
    replays: list[tuple[int | None, int | None]] = []

    class Replay:
        def __init__(self, state: static_decode._StepState) -> None:
            self.state, self.kv_len = state, state.kv_len

        def replay(self) -> None:
            replays.append((self.kv_len, self.state.kv_len))
            saved, self.state.kv_len = self.state.kv_len, self.kv_len  # as baked into the graph
            self.state.advance()
            self.state.kv_len = saved

        def pool(self) -> None:
            return None

    def capture(state: static_decode._StepState, pool: object = None) -> Replay:
        state.advance()  # the warm-up step
        captured.append(state.kv_len)
        return Replay(state)

    monkeypatch.setattr(static_decode, "graph_mode", lambda requested, model, device: "step")
    monkeypatch.setattr(static_decode, "_capture", capture)
    _, got = _decode_key_lengths(4, monkeypatch)
    monkeypatch.undo()
    _, want = _decode_key_lengths(0, monkeypatch)
    assert len(captured) >= 2 and len(set(captured)) == len(captured)  # one capture per bucket
    assert replays and all(baked == wanted for baked, wanted in replays)
    assert torch.equal(got["input_ids"], want["input_ids"])
