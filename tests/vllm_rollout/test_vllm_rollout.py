"""The vLLM rollout beyond the conformance suite: several weight syncs, both weight
transports, release/resume on CPU (engine restart) with synced weights, memory numbers,
plugin metadata. Real vLLM (CPU build), fp32, compared with a plain transformers
teacher-forced forward (what the FSDP engine's log-probs equal)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("vllm")

from geartrain import plugins  # noqa: E402
from geartrain.config import ModelConfig, RolloutConfig  # noqa: E402
from geartrain.errors import GeartrainError  # noqa: E402
from geartrain.rollout import Rollout  # noqa: E402
from geartrain.testing.rollout_suite import (  # noqa: E402
    encode_prompts,
    named_tensors,
    responses,
    teacher_forced_log_probs,
)
from geartrain.testing.tiny import tiny_model  # noqa: E402
from geartrain.types import EngineContext, SamplingParams  # noqa: E402
from geartrain_vllm.engine import CPU_TINY_OVERRIDES  # noqa: E402

#: a hang guard only, for a child process (a Python start-up importing torch, a make run):
#: far above what it takes on a loaded machine, so it never decides a test
HANG_GUARD_S = 600

ATOL = 1e-4
OVERRIDES = CPU_TINY_OVERRIDES["qwen2"]
SAMPLING = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=123)


def model_config(seed: int = 0) -> ModelConfig:
    return ModelConfig(tiny="qwen2", seed=seed, config_overrides=OVERRIDES)


def reference(seed: int) -> torch.nn.Module:
    return tiny_model("qwen2", seed=seed, **OVERRIDES)


def max_logprob_error(batch, model: torch.nn.Module) -> float:  # noqa: ANN001
    return float((teacher_forced_log_probs(model, batch) - batch["rollout_log_probs"]).abs().max())


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return encode_prompts()


@pytest.fixture(scope="module")
def models() -> dict[int, torch.nn.Module]:
    return {seed: reference(seed) for seed in (0, 1, 2)}


@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rollout]:
    config = RolloutConfig(
        backend="vllm",
        max_model_len=64,
        kv_cache_bytes=64 << 20,
        weight_bucket_bytes=64 << 10,  # several buckets for the tiny model in "buckets" mode
        options={"work_dir": str(tmp_path_factory.mktemp("vllm"))},
    )
    r = Rollout(config, model_config(seed=0), EngineContext(role="rollout"))
    yield r
    r.shutdown()


def test_initial_weights_are_the_model_configs(rollout: Rollout, models, prompts) -> None:  # noqa: ANN001
    batch = rollout.generate(prompts, SAMPLING)
    assert max_logprob_error(batch, models[0]) <= ATOL


def test_logprobs_follow_several_syncs(rollout: Rollout, models, prompts) -> None:  # noqa: ANN001
    """Each sync to other weights: log-probs equal that model's teacher-forced ones and the
    samples change; syncing the first weights back reproduces the first samples."""
    rollout.update_weights(named_tensors(models[0]))
    first = rollout.generate(prompts, SAMPLING)
    assert max_logprob_error(first, models[0]) <= ATOL
    seen = [responses(first)]
    for seed in (1, 2, 1, 2):
        rollout.update_weights(named_tensors(models[seed]))
        batch = rollout.generate(prompts, SAMPLING)
        assert max_logprob_error(batch, models[seed]) <= ATOL, f"after sync to seed {seed}"
        assert responses(batch) != seen[0], "samples did not change with the weights"
        seen.append(responses(batch))
    assert seen[1] == seen[3] and seen[2] == seen[4], "same weights and seed must give the same samples"
    rollout.update_weights(named_tensors(models[0]))
    back = rollout.generate(prompts, SAMPLING)
    assert torch.equal(back["input_ids"], first["input_ids"])
    assert torch.allclose(back["rollout_log_probs"], first["rollout_log_probs"], atol=ATOL, rtol=0)


def test_bucketed_transport_equals_streaming(rollout: Rollout, models, prompts) -> None:  # noqa: ANN001
    """The per-bucket RPC path (used when the engine's workers are other processes) loads
    the same weights as the single streamed call, even with buckets that split fused layers."""
    options = rollout.handle.options
    rollout.update_weights(named_tensors(models[1]))
    streamed = rollout.generate(prompts, SAMPLING)
    options.weight_sync = "buckets"
    try:
        rollout.update_weights(named_tensors(models[0]))
        rollout.update_weights(named_tensors(models[1]))
        bucketed = rollout.generate(prompts, SAMPLING)
    finally:
        options.weight_sync = "auto"
    assert torch.equal(bucketed["input_ids"], streamed["input_ids"])
    assert max_logprob_error(bucketed, models[1]) <= ATOL
    rollout.update_weights(named_tensors(models[0]))


def test_sync_statistics_and_lazy_consumption(rollout: Rollout, models) -> None:  # noqa: ANN001
    pulled: list[str] = []

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors(models[0]):
            pulled.append(name)
            yield name, tensor

    rollout.update_weights(stream())
    stats = rollout.handle.last_sync
    state = models[0].state_dict()
    assert stats.num_tensors == len(state) == len(pulled)
    assert stats.bytes == sum(t.numel() * t.element_size() for t in state.values())
    assert stats.seconds > 0


def test_release_resume_restarts_with_synced_weights(rollout: Rollout, models, prompts) -> None:  # noqa: ANN001
    """On CPU, release shuts vLLM down (memory measured) and resume restarts it with the
    last synced weights, not the ones the model directory holds."""
    rollout.update_weights(named_tensors(models[2]))
    before = rollout.generate(prompts, SAMPLING)
    released = rollout.release()
    kv_bytes = rollout.config.kv_cache_bytes
    assert released.freed > kv_bytes // 2, f"release freed {released.freed} bytes; the KV cache alone is {kv_bytes}"
    assert rollout.handle.weight_copy.spilled
    with pytest.raises(GeartrainError, match="resume"):
        rollout.generate(prompts, SAMPLING)
    resumed = rollout.resume()
    assert resumed.after > resumed.before
    after = rollout.generate(prompts, SAMPLING)
    assert torch.equal(after["input_ids"], before["input_ids"])
    assert max_logprob_error(after, models[2]) <= ATOL


def test_sync_while_released_applies_at_resume(rollout: Rollout, models, prompts) -> None:  # noqa: ANN001
    rollout.update_weights(named_tensors(models[2]))
    rollout.release()
    rollout.update_weights(named_tensors(models[1]))
    rollout.resume()
    batch = rollout.generate(prompts, SAMPLING)
    assert max_logprob_error(batch, models[1]) <= ATOL
    rollout.update_weights(named_tensors(models[0]))


def test_unknown_tensor_leaves_engine_usable(rollout: Rollout, models, prompts) -> None:  # noqa: ANN001
    state = models[1].state_dict()
    names = ["model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.gate_proj.weight"]
    stream = [(n, state[n]) for n in names] + [("model.layers.7.bogus", torch.zeros(3))]
    with pytest.raises(GeartrainError, match="model.layers.7.bogus"):
        rollout.update_weights(iter(stream))
    rollout.update_weights(named_tensors(models[0]))
    batch = rollout.generate(prompts, SAMPLING)
    assert max_logprob_error(batch, models[0]) <= ATOL


# --------------------------------------------------------------------------- no engine needed


def test_plugin_is_listed_with_its_capabilities() -> None:
    info = plugins.backend_info("rollout", "vllm")
    assert info.distribution == "geartrain-vllm" and info.version == "0.1.0"
    assert {"cpu", "cuda", "tensor_parallel", "release_memory"} <= set(info.capabilities)
    assert {"build_rollout", "generate", "update_weights", "release", "resume", "shutdown"} <= set(info.hooks)


def test_options_are_validated_with_their_path() -> None:
    from geartrain.validation import validate_backend_sections
    from pydantic import BaseModel

    class Root(BaseModel):
        rollout: RolloutConfig

    root = Root(rollout=RolloutConfig(backend="vllm", options={"enforce_eager": "maybe", "nope": 1}))
    paths = {path for path, _ in validate_backend_sections(root)}
    assert paths == {"rollout.options.enforce_eager", "rollout.options.nope"}


def test_unsupported_head_size_is_refused_with_the_fix() -> None:
    with pytest.raises(GeartrainError, match="config_overrides"):
        Rollout(RolloutConfig(backend="vllm"), ModelConfig(tiny="qwen2"), EngineContext(role="rollout"))


def test_importing_the_plugin_does_not_import_vllm() -> None:
    code = "import sys, geartrain_vllm.plugin as p; p.capabilities(); p.config_schema(); print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S, check=True)
    assert out.stdout.strip() == "False"


def test_min_p_and_repetition_penalty_reach_vllm() -> None:
    from geartrain import SamplingParams
    from geartrain_vllm.requests import build_requests

    assert {"min_p", "repetition_penalty"} <= set(plugins.backend_info("rollout", "vllm").capabilities)
    params = build_requests([[1, 2, 3]], SamplingParams(n=2, min_p=0.05, repetition_penalty=1.2)).params
    assert (params.min_p, params.repetition_penalty) == (0.05, 1.2)


def test_a_start_that_fails_leaves_no_work_directory(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """The rollout's own temporary work directory (the model written for vLLM) is removed
    when the engine's start fails, not only at shutdown (each full test run left a
    /tmp/geartrain-vllm-* behind)."""
    import gc
    import tempfile

    from geartrain_vllm import engine

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("vLLM refused to start")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(engine, "start_engine", refuse)
    with pytest.raises(RuntimeError, match="vLLM refused to start"):
        Rollout(RolloutConfig(backend="vllm", max_model_len=64), model_config(), EngineContext(role="rollout"))
    gc.collect()
    assert list(tmp_path.iterdir()) == []
