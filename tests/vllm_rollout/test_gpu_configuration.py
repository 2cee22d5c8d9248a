"""The vLLM rollout's GPU configuration (issue 33 item 7), checked as configuration on CPU:
CUDA graphs on by default on a GPU, and one ``n``-sample request per prompt with the
engine's seed as an option."""

from __future__ import annotations

from pathlib import Path

import pytest
from geartrain import ModelConfig, RolloutConfig, SamplingParams
from geartrain_vllm.engine import engine_kwargs
from geartrain_vllm.options import VllmOptions
from geartrain_vllm.requests import build_requests


def _kwargs(device: str, **options: object) -> dict:
    config = RolloutConfig(backend="vllm", max_model_len=64)
    return engine_kwargs(config, ModelConfig(tiny="qwen2"), VllmOptions(**options), Path("/nonexistent"), device)


def test_cuda_graphs_on_by_default_on_a_gpu_only() -> None:
    assert _kwargs("cuda")["enforce_eager"] is False
    assert _kwargs("cpu")["enforce_eager"] is True
    assert _kwargs("cuda", enforce_eager=True)["enforce_eager"] is True
    assert _kwargs("cuda", seed=7)["seed"] == 7


def test_per_prompt_requests_carry_n_samples_and_no_seed() -> None:
    prompts = [[1, 2, 3], [4, 5], [6]]
    sampling = SamplingParams(n=4, temperature=1.0, max_tokens=9, seed=11)
    per_sample = build_requests(prompts, sampling)
    assert len(per_sample.prompts) == 12 and per_sample.owners == [i for i in range(3) for _ in range(4)]
    assert {p.n for p in per_sample.params} == {1} and len({p.seed for p in per_sample.params}) == 12
    per_prompt = build_requests(prompts, sampling, per_prompt=True)
    assert per_prompt.owners == [0, 1, 2]
    assert [p["prompt_token_ids"] for p in per_prompt.prompts] == prompts
    assert per_prompt.params.n == 4 and per_prompt.params.seed is None and per_prompt.params.max_tokens == 9
    budgets = build_requests(
        prompts, SamplingParams(n=2, seed=1, max_tokens_per_prompt=[3, 5, 7]), per_prompt=True
    ).params
    assert [(p.n, p.seed, p.max_tokens) for p in budgets] == [(2, None, 3), (2, None, 5), (2, None, 7)]
    greedy = build_requests(prompts, SamplingParams(n=2, temperature=0.0, seed=1), per_prompt=True)
    assert len(greedy.owners) == 6  # vLLM refuses greedy n > 1: still one request per sample
    assert VllmOptions(seeded_requests="per_prompt").seeded_requests == "per_prompt"


def test_engine_kwargs_that_geartrain_sets_itself_are_refused_naming_the_setting() -> None:
    """Issue 35, round 14: ``engine_kwargs = {max_model_len = 8}`` silently overrode
    ``rollout.max_model_len = 32``: ``check`` measured prompts against 32, and every response
    was cut to 2 tokens (exit 0)."""
    import pydantic

    with pytest.raises(pydantic.ValidationError, match=r"max_model_len \(set rollout.max_model_len\)"):
        VllmOptions(engine_kwargs={"max_model_len": 8})
    assert VllmOptions(engine_kwargs={"block_size": 32}).engine_kwargs == {"block_size": 32}


def test_what_vllms_cpu_backend_cannot_start_is_named_before_it_starts() -> None:
    """Issue 35, round 14: ``rollout.kv_cache_bytes = 1`` ended in an 80-line vLLM traceback
    advising gpu_memory_utilization; ``rollout.tensor_parallel_size = 2`` on a machine of one
    NUMA node in vLLM's AssertionError. Each is one line naming the setting."""
    from geartrain.errors import ConfigError
    from geartrain_vllm.engine import _numa_nodes, check_supported

    model = ModelConfig(tiny="qwen2", config_overrides={"num_attention_heads": 2, "num_key_value_heads": 1})
    with pytest.raises(ConfigError, match=r"kv_cache_bytes: 1 bytes hold less than one sequence"):
        check_supported(model, "cpu", RolloutConfig(backend="vllm", max_model_len=32, kv_cache_bytes=1))
    check_supported(model, "cpu", RolloutConfig(backend="vllm", max_model_len=32, kv_cache_bytes=1 << 20))
    too_many = _numa_nodes() + 1
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: .* NUMA node"):
        check_supported(model, "cpu", RolloutConfig(backend="vllm", tensor_parallel_size=too_many))
