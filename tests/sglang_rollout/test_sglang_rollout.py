"""The SGLang rollout beyond the conformance suite: several weight syncs over both
transports (shared-memory tensors, a gloo process group), the tied output layer,
release/resume on CPU (engine restart) with synced weights
and measured memory. Real SGLang Engine (CPU recipe), fp32, compared with a plain
transformers teacher-forced forward (what the FSDP engine's log-probs equal)."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("sglang")

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

ATOL = 1e-4
SAMPLING = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=123)


def max_logprob_error(batch, model: torch.nn.Module) -> float:  # noqa: ANN001
    return float((teacher_forced_log_probs(model, batch) - batch["rollout_log_probs"]).abs().max())


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return encode_prompts()


@pytest.fixture(scope="module")
def models() -> dict[int, torch.nn.Module]:
    return {seed: tiny_model("qwen2", seed=seed) for seed in (0, 1, 2)}


@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rollout]:
    config = RolloutConfig(
        backend="sglang",
        max_model_len=64,
        kv_cache_bytes=16 << 20,
        weight_bucket_bytes=64 << 10,  # several buckets for the tiny model
        options={"work_dir": str(tmp_path_factory.mktemp("sglang"))},
    )
    r = Rollout(config, ModelConfig(tiny="qwen2", seed=0), EngineContext(role="rollout"))
    yield r
    r.shutdown()


@pytest.fixture
def transport(rollout: Rollout, request: pytest.FixtureRequest) -> Iterator[str]:
    options = rollout.handle.options
    options.weight_sync = request.param
    yield request.param
    options.weight_sync = "tensor"


def test_initial_weights_are_the_model_configs(rollout: Rollout, models, prompts) -> None:  # noqa: ANN001
    batch = rollout.generate(prompts, SAMPLING)
    assert max_logprob_error(batch, models[0]) <= ATOL


@pytest.mark.parametrize("transport", ["tensor", "distributed"], indirect=True)
def test_logprobs_follow_several_syncs(rollout: Rollout, models, prompts, transport: str) -> None:  # noqa: ANN001
    """Each sync to other weights: log-probs equal that model's teacher-forced ones and the
    samples change; syncing the first weights back reproduces the first samples."""
    rollout.update_weights(named_tensors(models[0]))
    first = rollout.generate(prompts, SAMPLING)
    assert max_logprob_error(first, models[0]) <= ATOL
    seen = [responses(first)]
    for seed in (1, 2, 1, 2):
        rollout.update_weights(named_tensors(models[seed]))
        assert rollout.handle.last_sync.num_buckets > 1
        batch = rollout.generate(prompts, SAMPLING)
        assert max_logprob_error(batch, models[seed]) <= ATOL, f"{transport}: after sync to seed {seed}"
        assert responses(batch) != seen[0], "samples did not change with the weights"
        seen.append(responses(batch))
    assert seen[1] == seen[3] and seen[2] == seen[4], "same weights and seed must give the same samples"
    rollout.update_weights(named_tensors(models[0]))
    back = rollout.generate(prompts, SAMPLING)
    assert torch.equal(back["input_ids"], first["input_ids"])
    assert torch.allclose(back["rollout_log_probs"], first["rollout_log_probs"], atol=ATOL, rtol=0)


def test_transports_load_the_same_weights(rollout: Rollout, models, prompts) -> None:  # noqa: ANN001
    options = rollout.handle.options
    rollout.update_weights(named_tensors(models[2]))
    by_tensor = rollout.generate(prompts, SAMPLING)
    options.weight_sync = "distributed"
    try:
        rollout.update_weights(named_tensors(models[0]))
        rollout.update_weights(named_tensors(models[2]))
        by_group = rollout.generate(prompts, SAMPLING)
    finally:
        options.weight_sync = "tensor"
        rollout.update_weights(named_tensors(models[0]))
    assert torch.equal(by_group["input_ids"], by_tensor["input_ids"])
    assert max_logprob_error(by_group, models[2]) <= ATOL


def test_tied_output_layer_follows_either_name(rollout: Rollout, models, prompts) -> None:  # noqa: ANN001
    """qwen2's output layer is its input embedding: a sync that names only
    ``lm_head.weight`` must change both (SGLang's loader alone would skip that name)."""
    assert models[0].config.tie_word_embeddings
    source = models[1].state_dict()["lm_head.weight"]
    hybrid = copy.deepcopy(models[0])
    hybrid.load_state_dict({"lm_head.weight": source}, strict=False)
    assert torch.equal(hybrid.model.embed_tokens.weight, source)
    try:
        rollout.update_weights(iter([("lm_head.weight", source.clone())]))
        batch = rollout.generate(prompts, SAMPLING)
        assert max_logprob_error(batch, hybrid) <= ATOL
        assert max_logprob_error(batch, models[0]) > 1e-3
    finally:
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
    assert stats.num_buckets >= stats.bytes // rollout.config.weight_bucket_bytes
    assert stats.seconds > 0


def test_release_resume_restarts_with_synced_weights(rollout: Rollout, models, prompts) -> None:  # noqa: ANN001
    """On CPU, release shuts the engine down (its scheduler process, holding weights and KV
    cache, exits: measured) and resume restarts it with the last synced weights, including
    a sync made while released."""
    rollout.update_weights(named_tensors(models[2]))
    before = rollout.generate(prompts, SAMPLING)
    pids = set(rollout.handle._pids)
    released = rollout.release()
    kv_bytes = rollout.config.kv_cache_bytes
    assert released.freed > kv_bytes, f"release freed {released.freed} bytes; the KV cache alone is {kv_bytes}"
    assert rollout.handle.weight_copy.spilled
    assert not any(_alive(pid) for pid in pids), "the engine's processes outlived release"
    with pytest.raises(GeartrainError, match="resume"):
        rollout.generate(prompts, SAMPLING)
    rollout.update_weights(named_tensors(models[1]))
    rollout.update_weights(named_tensors(models[2]))
    resumed = rollout.resume()
    assert resumed.after - resumed.before > kv_bytes
    after = rollout.generate(prompts, SAMPLING)
    assert torch.equal(after["input_ids"], before["input_ids"])
    assert max_logprob_error(after, models[2]) <= ATOL
    rollout.update_weights(named_tensors(models[0]))


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_unknown_tensor_is_named_and_engine_stays_usable(rollout: Rollout, models, prompts) -> None:  # noqa: ANN001
    state = models[1].state_dict()
    stream = [("model.layers.0.mlp.down_proj.weight", state["model.layers.0.mlp.down_proj.weight"])]
    stream.append(("model.layers.7.bogus", torch.zeros(3)))
    with pytest.raises(GeartrainError, match="model.layers.7.bogus"):
        rollout.update_weights(iter(stream))
    rollout.update_weights(named_tensors(models[0]))
    batch = rollout.generate(prompts, SAMPLING)
    assert max_logprob_error(batch, models[0]) <= ATOL


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("token", r"prompt 1 has token ids outside the vocabulary \(size \d+\): \[\d+\]"),
        ("top_p", r"sampling.top_p must be in \(0, 1\]"),
    ],
)
def test_bad_input_is_refused_before_the_engine(
    rollout: Rollout,
    models,  # noqa: ANN001
    prompts,  # noqa: ANN001
    bad: str,
    message: str,
) -> None:
    """The core's input checks (geartrain.layout.check_generate_inputs) run on the whole batch
    first: an out-of-vocabulary id names its prompt and the engine keeps generating."""
    vocab = models[0].config.vocab_size
    batch_prompts, sampling = list(prompts), SAMPLING
    if bad == "token":
        batch_prompts[1] = [*prompts[1], vocab + 3]
    else:
        sampling = SamplingParams(n=3, temperature=1.0, top_p=1.5, max_tokens=12, seed=123)
    with pytest.raises(GeartrainError, match=f"^sglang rollout: {message}"):
        rollout.generate(batch_prompts, sampling)
    batch = rollout.generate(prompts, SAMPLING)
    assert max_logprob_error(batch, models[0]) <= ATOL


def test_a_start_that_fails_leaves_no_work_directory(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """The rollout's own temporary work directory (the model written for SGLang) is removed
    when the engine's start fails, not only at shutdown (each full test run left a
    /tmp/geartrain-sglang-* behind)."""
    import gc
    import tempfile

    from geartrain_sglang import engine

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("SGLang refused to start")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(engine, "start_engine", refuse)
    with pytest.raises(RuntimeError, match="SGLang refused to start"):
        Rollout(
            RolloutConfig(backend="sglang", max_model_len=64), ModelConfig(tiny="qwen2"), EngineContext(role="rollout")
        )
    gc.collect()
    assert list(tmp_path.iterdir()) == []
