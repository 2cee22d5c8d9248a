"""The fused token choice (:mod:`geartrain.rollouts.fused_sampler`): today's tokens with the
same noise, the unscaled log-prob, and fewer passes over ``[B, vocab]``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from geartrain import EngineContext, ModelConfig, Rollout, RolloutConfig, SamplingParams
from geartrain.rollouts import fused_sampler, static_decode
from geartrain.rollouts.fused_sampler import is_plain, sample_with_log_prob
from geartrain.rollouts.sampler import sample_tokens
from geartrain.testing.rollout_suite import encode_prompts
from torch.utils._python_dispatch import TorchDispatchMode

ROWS, VOCAB = 48, 3001


def _logits(seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def _today(logits: torch.Tensor, sampling: SamplingParams, seeds: torch.Tensor, counter: int) -> tuple[Any, Any]:
    """The path the fused one replaces: sample_tokens, then gather - logsumexp."""
    raw = logits.float()
    tokens = sample_tokens(raw, sampling, seeds, counter)
    return tokens, raw.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(raw, dim=-1)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=20),
        SamplingParams(temperature=0.0),
    ],
    ids=["t1", "t0.7", "t1.3", "top_p", "top_k", "greedy"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_tokens_and_log_probs_as_today(sampling: SamplingParams, dtype: torch.dtype) -> None:
    seeds = torch.arange(ROWS, dtype=torch.int64) * 7919 + 11
    for counter in range(12):
        logits = _logits(counter).to(dtype)
        want_tok, want_lp = _today(logits, sampling, seeds, counter)
        tok, lp = sample_with_log_prob(logits, sampling, seeds, counter)
        assert torch.equal(tok, want_tok), (counter, int((tok != want_tok).sum()))
        assert lp.dtype == torch.float32
        err = float((lp - want_lp).abs().max())
        assert err < 2e-5, err


def test_device_counter_gives_the_int_counter_tokens() -> None:
    seeds = torch.arange(ROWS, dtype=torch.int64)
    logits, sampling = _logits(3), SamplingParams(temperature=1.0)
    a = sample_with_log_prob(logits, sampling, seeds, 5)
    b = sample_with_log_prob(logits, sampling, seeds, torch.tensor(5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_non_finite_row_keeps_its_token_inside_the_vocabulary(temperature: float) -> None:
    """As sample_tokens since issue 39: a NaN row draws an index inside the vocabulary and
    gets a NaN log-prob (which the rollout batch refuses); the other rows are unchanged."""
    logits = _logits(5)
    logits[3] = float("nan")
    logits[7, 10] = float("inf")
    seeds = torch.arange(ROWS, dtype=torch.int64)
    sampling = SamplingParams(temperature=temperature)
    tokens, lps = sample_with_log_prob(logits, sampling, seeds, 2)
    assert int(tokens.max()) < VOCAB
    assert torch.isnan(lps[3]) and not torch.isfinite(lps[7])
    finite = [i for i in range(ROWS) if i not in (3, 7)]
    want, _ = _today(logits[finite], sampling, seeds[finite], 2)
    assert torch.equal(tokens[finite], want)


class _FullSizeOps(TorchDispatchMode):
    """The aten ops that produce a ``[ROWS, VOCAB]`` tensor: each is a pass over the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() == ROWS * VOCAB:
            self.ops.append(str(func.overloadpacket.__name__))
        return out


def _full_size_ops(fn: Any, logits: torch.Tensor, sampling: SamplingParams) -> list[str]:
    seeds = torch.arange(ROWS, dtype=torch.int64)
    with _FullSizeOps() as mode:
        fn(logits, sampling, seeds, 0)
    return mode.ops


def test_temperature_one_is_three_passes_without_a_division() -> None:
    """bf16 logits at temperature 1.0, run eagerly: the widening copy, then x - max, its exp
    and the CDF; no division, no softmax normalisation, no second exp for the log-prob (under
    compile on CUDA these fuse)."""
    sampling = SamplingParams(temperature=1.0)
    logits = _logits(0).to(torch.bfloat16)
    today = _full_size_ops(_today, logits, sampling)
    fused = _full_size_ops(sample_with_log_prob, logits, sampling)
    assert "div" in today and "div" not in fused
    assert fused == ["_to_copy", "sub", "exp", "cumsum"], fused
    assert "_softmax" in today and "_softmax" not in fused
    assert is_plain(sampling) and not is_plain(SamplingParams(temperature=1.0, top_p=0.5))


def test_static_decode_samples_with_the_fused_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = fused_sampler.sample_with_log_prob

    def spy(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(static_decode, "sample_with_log_prob", spy)
    rollout = Rollout(
        RolloutConfig(backend="torch", max_model_len=64, options={"static_cache": True}),
        ModelConfig(tiny="qwen2", seed=0),
        EngineContext(role="rollout"),
    )
    try:
        batch = rollout.generate(encode_prompts()[:2], SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=1))
    finally:
        rollout.shutdown()
    assert len(calls) == 5  # one per token of the chunk
    assert batch["rollout_log_probs"].shape[0] == 4
