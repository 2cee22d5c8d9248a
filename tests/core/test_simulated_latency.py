"""The torch rollout's simulated generation time (``options.simulated_token_s``, benchmarks):
each sample finishes at its own time in a continuous-batching engine, a plain ``generate``
lasts as long as its longest sample, a streaming one returns the finish times instead, and
a weight update takes effect once the samples in flight have finished."""

from __future__ import annotations

import time

import pytest
from geartrain import EngineContext, ModelConfig, Rollout, RolloutConfig, SamplingParams
from geartrain.layout import READY_AT
from geartrain.rollouts.torch_rollout import simulated_lengths
from geartrain.seeding import sample_seed

TOKEN_S = 0.02
SAMPLING = SamplingParams(n=4, temperature=1.0, max_tokens=4, seed=7)
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def _rollout(token_s: float = TOKEN_S) -> Rollout:
    options = {"simulated_token_s": token_s, "simulated_tail_alpha": 0.8, "simulated_max_tokens": 60}
    return Rollout(
        RolloutConfig(backend="torch", max_model_len=64, options=options),
        ModelConfig(tiny="qwen2", seed=0),
        EngineContext(role="rollout"),
    )


def _lengths(rollout: Rollout) -> list[int]:
    seeds = [sample_seed(SAMPLING.seed, i, j) for i in range(len(PROMPTS)) for j in range(SAMPLING.n)]
    return simulated_lengths(rollout.handle.options, seeds)


def test_each_sample_finishes_at_its_own_time_and_a_plain_call_waits_for_the_longest() -> None:
    rollout = _rollout()
    lengths = _lengths(rollout)
    assert len(set(lengths)) > 2, lengths  # a spread of lengths, or the test shows nothing
    batch = rollout.generate(PROMPTS, SAMPLING, stream=True)
    ready = batch.meta[READY_AT]
    start = ready[0] - TOKEN_S * lengths[0]
    assert ready == pytest.approx([start + TOKEN_S * n for n in lengths], abs=1e-6)

    started = time.time()
    plain = rollout.generate(PROMPTS, SAMPLING)
    assert READY_AT not in plain.meta
    assert time.time() - started >= TOKEN_S * max(lengths) - 1e-3  # as long as the longest sample
    assert plain["input_ids"].tolist() == batch["input_ids"].tolist()  # only the time is simulated


def test_a_weight_update_takes_effect_after_the_samples_in_flight() -> None:
    # streamed calls only report finish times (nothing here waits on them), so a token can take
    # a minute: the samples stay in flight whatever the machine's load (at 0.02 s a token they
    # were done when two generate calls took longer than the longest sample, ~1 s)
    token_s = 60.0
    rollout = _rollout(token_s)
    shortest = token_s * min(_lengths(rollout))
    first = rollout.generate(PROMPTS, SAMPLING, stream=True).meta[READY_AT]
    asked = time.time()
    second = rollout.generate(PROMPTS, SAMPLING, stream=True).meta[READY_AT]
    answered = time.time()
    # without an update a request joins the running ones at once (continuous batching)
    assert asked - 1e-6 <= min(second) - shortest <= answered
    rollout.update_weights(iter([]))  # nothing changes, but it is an update between requests
    in_flight = max(first + second)
    assert in_flight > time.time(), "the samples are done already: the test shows nothing"
    third = rollout.generate(PROMPTS, SAMPLING, stream=True).meta[READY_AT]
    # after the update, a request starts when every sample in flight is done
    assert min(third) == pytest.approx(in_flight + shortest, abs=1e-6)
