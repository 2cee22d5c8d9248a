"""The torch rollout's GQA-native decode attention (:mod:`geartrain.rollouts.gqa_attention`):
the same numbers as transformers' ``sdpa`` path, without expanding the KV cache."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from geartrain import EngineContext, ModelConfig, Rollout, RolloutConfig, SamplingParams
from geartrain.rollouts.gqa_attention import GQA_DECODE, gqa_decode_attention, use_gqa_decode
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
