"""The torch rollout: the conformance suite, plus checks of its own sampler, batching and
memory release."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch
from geartrain import EngineContext, GeartrainError, ModelConfig, Rollout, RolloutConfig, SamplingParams
from geartrain.layout import cut_at_stop
from geartrain.rollouts import sampler, torch_rollout
from geartrain.testing import RolloutConformance
from geartrain.testing.rollout_suite import encode_prompts, named_tensors, teacher_forced_log_probs
from geartrain.testing.tiny import tiny_model


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine the
    threads' barriers stall: one generate measured 0.03 s with 1 thread, 2.6 s with 2."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class TestTorchRollout(RolloutConformance):
    backend = "torch"
    # Small chunks, so the suite also runs through the chunking path.
    options = {"max_batch_size": 16}


def make_rollout(family: str = "qwen2", **options: object) -> Rollout:
    return Rollout(
        RolloutConfig(backend="torch", max_model_len=64, options=dict(options)),
        ModelConfig(tiny=family, seed=0),
        EngineContext(role="rollout"),
    )


@pytest.fixture(scope="module")
def rollout() -> Iterator[Rollout]:
    r = make_rollout(max_batch_size=1024)
    yield r
    r.shutdown()


# --------------------------------------------------------------------------- log-probs


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_hook_generate_logprobs_within_1e5_of_teacher_forced_fp32(family: str) -> None:
    r = make_rollout(family)
    try:
        batch = r.generate(encode_prompts(), SamplingParams(n=4, temperature=0.8, max_tokens=16, seed=0))
        expected = teacher_forced_log_probs(tiny_model(family, seed=0), batch)
        err = float((batch["rollout_log_probs"] - expected).abs().max())
        assert err < 1e-5, err
        assert int(batch["response_mask"].sum()) == 4 * 4 * 16
    finally:
        r.shutdown()


# --------------------------------------------------------------------------- sampler


def _reference_filter(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The kept set, token by token: top-k by rank, then the nucleus of the renormalised rest."""
    scaled = logits / temperature
    keep = torch.ones_like(scaled, dtype=torch.bool)
    for row in range(scaled.shape[0]):
        order = sorted(range(scaled.shape[1]), key=lambda t: -float(scaled[row, t]))
        if top_k > 0:
            for t in order[top_k:]:
                keep[row, t] = False
        kept = [t for t in order if keep[row, t]]
        probs = torch.softmax(scaled[row, kept], dim=-1)
        mass = 0.0
        for t, p in zip(kept, probs.tolist(), strict=True):
            if mass >= top_p:
                keep[row, t] = False
            mass += p
    return keep


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (-1, 0.4), (10, 0.6), (1, 1.0), (-1, 1.0)])
def test_filter_logits_matches_reference(top_k: int, top_p: float) -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 2
    filtered = sampler.filter_logits(logits, 0.7, top_k, top_p)
    kept = torch.isfinite(filtered)
    assert torch.equal(kept, _reference_filter(logits, 0.7, top_k, top_p))
    assert torch.allclose(filtered[kept], (logits / 0.7)[kept])


def test_sampled_frequencies_follow_the_filtered_distribution() -> None:
    """20,000 draws of one row (one stream per seed) land on each token at its filtered
    probability; a tensor counter (the CUDA-graph path) draws exactly what the int does."""
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(3)).repeat(20000, 1) * 1.5
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.95)
    seeds = torch.arange(20000, dtype=torch.int64) * 104729 + 17
    tokens = sampler.sample_tokens(logits, params, seeds, 5)
    assert torch.equal(tokens, sampler.sample_tokens(logits, params, seeds, torch.tensor(5)))
    want = torch.softmax(sampler.filter_logits(logits[:1].double(), 0.8, 8, 0.95), dim=-1)[0]
    got = torch.bincount(tokens, minlength=12).double() / 20000
    assert float((got - want).abs().max()) < 0.012, (got, want)
    assert bool((want[tokens] > 0).all())  # never a filtered-out token


def test_a_draw_at_the_top_of_the_cdf_takes_the_last_token_with_mass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A uniform that rounds up to 1 in float32 runs the search past the cdf's end: the
    sampler must return the last token with mass, not the vocabulary's last id."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0, 0.5]])
    top = 1 - 2.0**-30  # rounds up to 1.0 in float32
    monkeypatch.setattr(sampler, "uniforms", lambda seeds, counter: torch.full((len(seeds),), top, dtype=torch.float64))
    token = sampler.sample_tokens(logits, SamplingParams(temperature=1.0, top_k=3), torch.tensor([1]), 0)
    assert token.tolist() == [3]  # top 3 = ids 1, 3, 2 in probability order; 3 is the highest id among them


@pytest.mark.parametrize("static", [False, True])
def test_the_prefill_computes_the_last_position_s_logits_only(static: bool) -> None:
    """One row of logits per prompt, not prompt length x vocabulary, on both decode paths."""
    r = make_rollout(static_cache=static)
    widths: list[int] = []
    model = r.handle.model
    real = model.forward

    @functools.wraps(real)  # keeps the signature the rollout inspects
    def recording(*args: object, **kwargs: object) -> object:
        out = real(*args, **kwargs)
        widths.append(out.logits.shape[1])
        return out

    model.forward = recording
    try:
        r.generate(encode_prompts()[:3], SamplingParams(n=2, max_tokens=3, seed=0))
    finally:
        r.shutdown()
    assert widths and set(widths) == {1}, widths
    assert torch_rollout.last_logits_only(torch.nn.Linear(1, 1)) == {}  # a forward without the argument: none given


# --------------------------------------------------------------------------- batching


def test_chunking_does_not_change_results() -> None:
    """Rows decoded one at a time, in chunks of 3, or all together: the same tokens
    (each row has its own random stream) and the same log-probs."""
    prompts = encode_prompts()[:3]
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=10, stop_token_ids=[2, 50, 60, 70, 80], seed=4)
    outs = []
    for size in (1, 3, 64):
        r = make_rollout(max_batch_size=size)
        try:
            outs.append(r.generate(prompts, sampling))
        finally:
            r.shutdown()
    for other in outs[1:]:
        assert torch.equal(other["input_ids"], outs[0]["input_ids"])
        assert torch.equal(other["response_mask"], outs[0]["response_mask"])
        assert other["finish_reason"] == outs[0]["finish_reason"]
        assert torch.allclose(other["rollout_log_probs"], outs[0]["rollout_log_probs"], atol=1e-5, rtol=0)
    assert "stop" in outs[0]["finish_reason"] and "length" in outs[0]["finish_reason"]


def test_hook_build_rollout_sizes_chunks_from_options_and_kv_cache_budget() -> None:
    prompts = encode_prompts()
    sampling = SamplingParams(max_tokens=16)
    longest = max(len(p) for p in prompts) + 16
    # qwen2 tiny: 2 layers, 2 KV heads of 16, fp32 -> 2 * 2 * 2 * 16 * 4 bytes per token.
    per_row = 2 * 2 * 2 * 16 * 4 * longest
    cases = [
        ({}, {}, 256),
        ({}, {"max_num_seqs": 7}, 7),
        ({"max_batch_size": 5}, {}, 5),
        ({}, {"kv_cache_bytes": 3 * per_row + 1}, 3),
        ({}, {"kv_cache_bytes": 1}, 1),
    ]
    for options, extra, expected in cases:
        r = Rollout(
            RolloutConfig(backend="torch", max_model_len=64, options=options, **extra),
            ModelConfig(tiny="qwen2"),
            EngineContext(role="rollout"),
        )
        assert torch_rollout.chunk_rows(r.handle, prompts, sampling) == expected, (options, extra)
        r.shutdown()


def test_no_seed_still_samples(rollout: Rollout) -> None:
    a = rollout.generate(encode_prompts()[:1], SamplingParams(n=2, temperature=1.0, max_tokens=8))
    b = rollout.generate(encode_prompts()[:1], SamplingParams(n=2, temperature=1.0, max_tokens=8))
    assert not torch.equal(a["input_ids"], b["input_ids"])


def test_empty_prompt_list(rollout: Rollout) -> None:
    batch = rollout.generate([], SamplingParams())
    assert len(batch) == 0 and batch.info["prompt_length"] == 0


# --------------------------------------------------------------------------- weights


def test_hook_update_weights_consumes_the_iterator_lazily(rollout: Rollout) -> None:
    """Each tensor is in the model before the next one is asked for."""
    other = tiny_model("qwen2", seed=1).state_dict()
    params = dict(rollout.handle.model.state_dict(keep_vars=True))
    seen: list[str] = []

    def stream():
        for name, tensor in other.items():
            if seen:
                assert torch.equal(params[seen[-1]], other[seen[-1]]), f"{seen[-1]} not applied before the next tensor"
            seen.append(name)
            yield name, tensor

    try:
        rollout.update_weights(stream())
        assert seen == list(other)
    finally:
        rollout.update_weights(named_tensors(tiny_model("qwen2", seed=0)))


def test_tied_embeddings_follow_either_name(rollout: Rollout) -> None:
    model = rollout.handle.model
    assert model.config.tie_word_embeddings
    new = torch.randn_like(model.lm_head.weight)
    try:
        rollout.update_weights([("lm_head.weight", new)])
        assert torch.equal(model.model.embed_tokens.weight, new)
    finally:
        rollout.update_weights(named_tensors(tiny_model("qwen2", seed=0)))


def test_update_weights_shape_mismatch_raises(rollout: Rollout) -> None:
    with pytest.raises(GeartrainError, match="model.norm.weight.*shape"):
        rollout.update_weights([("model.norm.weight", torch.ones(3))])


def test_hook_resume_is_needed_after_release_and_brings_the_same_samples(rollout: Rollout) -> None:
    prompts, sampling = encode_prompts()[:2], SamplingParams(n=2, max_tokens=4, seed=3)
    before = rollout.generate(prompts, sampling)
    rollout.release()
    try:
        with pytest.raises(GeartrainError, match="released"):
            rollout.generate(prompts, sampling)
        with pytest.raises(GeartrainError, match="released"):
            rollout.update_weights(named_tensors(tiny_model("qwen2", seed=0)))
    finally:
        rollout.resume()
    after = rollout.generate(prompts, sampling)
    assert torch.equal(after["input_ids"], before["input_ids"])
    assert torch.equal(after["rollout_log_probs"], before["rollout_log_probs"])


def test_hook_shutdown_makes_the_handle_unusable() -> None:
    r = make_rollout()
    r.shutdown()
    with pytest.raises(GeartrainError, match="after shutdown"):
        r.generate(encode_prompts()[:1], SamplingParams(max_tokens=2))
    with pytest.raises(GeartrainError, match="after shutdown"):
        r.resume()


# --------------------------------------------------------------------------- memory


def test_hook_release_frees_the_weights_for_real(tmp_path) -> None:
    """A model of ~40 MB of weights: release gives that memory back to the OS (resident
    set), resume brings the same weights back."""
    r = Rollout(
        RolloutConfig(backend="torch", max_model_len=64, options={"offload_dir": str(tmp_path)}),
        ModelConfig(
            tiny="llama", config_overrides={"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 3}
        ),
        EngineContext(role="rollout"),
    )
    try:
        model = r.handle.model
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        size = sum(v.numel() * v.element_size() for v in weights.values())
        assert size > 30e6
        released = r.release()
        assert released.detail["weight_bytes"] == size
        assert released.freed > 0.8 * size, f"freed {released.freed} of {size} bytes"
        assert all(p.numel() == 0 for p in model.parameters())
        assert len(list(tmp_path.iterdir())) == 1
        resumed = r.resume()
        assert resumed.after - resumed.before > 0.8 * size
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())
        assert list(tmp_path.iterdir()) == []
    finally:
        r.shutdown()


# --------------------------------------------------------------------------- config


def test_hook_config_schema_validates_the_options() -> None:
    with pytest.raises(Exception, match="max_batch_size"):
        make_rollout(max_batch_size=0)
    with pytest.raises(Exception, match="bogus"):
        make_rollout(bogus=1)


def test_hook_capabilities_of_the_torch_entry_point() -> None:
    from geartrain import plugins

    plugin, info = plugins.load_plugin("rollout", "torch")
    assert plugin is torch_rollout
    assert set(info.capabilities) >= {"cpu", "release_memory"}


def test_bfloat16_rollout_tracks_the_fp32_reference() -> None:
    r = Rollout(
        RolloutConfig(backend="torch", max_model_len=64, dtype="bfloat16"),
        ModelConfig(tiny="qwen2", seed=0),
        EngineContext(role="rollout"),
    )
    try:
        assert r.handle.model.model.embed_tokens.weight.dtype == torch.bfloat16
        batch = r.generate(encode_prompts(), SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=0))
        assert batch["rollout_log_probs"].dtype == torch.float32
        expected = teacher_forced_log_probs(tiny_model("qwen2", seed=0), batch)
        err = float((batch["rollout_log_probs"] - expected).abs().max())
        assert 0 < err < 0.1, err
    finally:
        r.shutdown()


# --------------------------------------------------------------------------- the suite's guard


def test_silent_override_of_a_standard_test_is_refused() -> None:
    with pytest.raises(TypeError, match=r"test_max_tokens.*overridden_tests"):

        class Silent(RolloutConformance):
            backend = "torch"

            def test_max_tokens(self) -> None:
                pass


def test_listed_override_is_accepted_and_inherited() -> None:
    class Listed(RolloutConformance):
        backend = "torch"
        overridden_tests = {"test_max_tokens": "this backend counts tokens differently"}

        def test_max_tokens(self) -> None:
            pass

    class Child(Listed):  # inherits both the override and its reason
        pass

    assert Child.test_max_tokens is Listed.test_max_tokens


def test_override_listing_an_unknown_test_is_refused() -> None:
    with pytest.raises(TypeError, match="test_does_not_exist"):

        class Typo(RolloutConformance):
            backend = "torch"
            overridden_tests = {"test_does_not_exist": "typo"}


def test_new_tests_in_a_subclass_need_no_listing() -> None:
    class Extra(RolloutConformance):
        backend = "torch"

        def test_something_else(self) -> None:
            pass

    standard = {n for n in vars(RolloutConformance) if n.startswith("test_")}
    assert {n for n in dir(Extra) if n.startswith("test_")} == standard | {"test_something_else"}
    assert all(getattr(Extra, n) is vars(RolloutConformance)[n] for n in standard), (
        "standard tests must stay as they are"
    )

    # the new test is the plugin's own: a subclass may replace it without listing it, while
    # the guard still covers the standard tests further down the hierarchy
    class Again(Extra):
        def test_something_else(self) -> None:
            pass

    with pytest.raises(TypeError, match=r"test_max_tokens.*overridden_tests"):

        class Sneaky(Extra):
            def test_max_tokens(self) -> None:
                pass


def test_the_engine_suite_has_the_same_guard() -> None:
    from geartrain.testing.engine_suite import EngineConformance

    with pytest.raises(TypeError, match=r"test_training_matches_plain_adamw.*overridden_tests"):

        class Silent(EngineConformance):
            backend = "simple"

            def test_training_matches_plain_adamw(self, family: str) -> None:
                pass

    class Said(EngineConformance):
        backend = "simple"
        overridden_tests = {"test_training_matches_plain_adamw": "this engine trains in bf16"}

        def test_training_matches_plain_adamw(self, family: str) -> None:
            pass


def test_samples_of_one_prompt_share_its_prefill() -> None:
    """n samples of a prompt: the prompt runs through the model once (the first forward
    has one row per distinct prompt); the log-probs are the model's, and sample 0 of each
    prompt is what an n = 1 request with the same seed (no sharing) draws."""
    r = make_rollout(max_batch_size=1024)
    try:
        rows: list[int] = []
        model = r.handle.model
        hook = model.register_forward_pre_hook(
            lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True
        )
        prompts = encode_prompts()[:3]
        shared = r.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=5))
        hook.remove()
        assert rows[0] == 3 and max(rows[1:]) == 12
        single = r.generate(prompts, SamplingParams(n=1, temperature=1.0, max_tokens=6, seed=5))
        expected = teacher_forced_log_probs(tiny_model("qwen2", seed=0), shared)
        assert float((shared["rollout_log_probs"] - expected).abs().max()) < 1e-5
        # sample 0 of each prompt is what an n=1 request with the same seed draws
        first = shared.index([0, 4, 8])
        assert torch.equal(first["input_ids"][:, : single["input_ids"].shape[1]], single["input_ids"])
    finally:
        r.shutdown()


# --------------------------------------------------------------------------- turns (stop sequences, budgets)


def test_stop_sequences_cut_each_row_where_a_one_shot_generation_first_ends_in_one(rollout: Rollout) -> None:
    prompts = encode_prompts()
    free = rollout.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=24, seed=5))
    # stop on two-token sequences that occur in some rows' free generations, not in others
    seqs = [free["input_ids"][0, free.info["prompt_length"] + 3 : free.info["prompt_length"] + 5].tolist(), [7, 7]]
    stopped = rollout.generate(
        prompts, SamplingParams(n=3, temperature=1.0, max_tokens=24, seed=5, stop_sequences=seqs)
    )
    width_free, width_stop = free.info["prompt_length"], stopped.info["prompt_length"]
    cuts = 0
    for row in range(len(free)):
        full = free["input_ids"][row, width_free:][free["response_mask"][row, width_free:].bool()].tolist()
        full_lp = free["rollout_log_probs"][row, width_free : width_free + len(full)].tolist()
        got = stopped["input_ids"][row, width_stop:][stopped["response_mask"][row, width_stop:].bool()].tolist()
        got_lp = stopped["rollout_log_probs"][row, width_stop : width_stop + len(got)].tolist()
        cut = cut_at_stop(full, seqs)
        assert got == full[: cut or len(full)], row
        assert got_lp == pytest.approx(full_lp[: len(got)], abs=1e-6)
        assert stopped["finish_reason"][row] == ("stop" if cut else free["finish_reason"][row])
        cuts += cut is not None and cut < len(full)
    assert cuts >= 1  # the test exercised a real cut


def test_stop_sequences_never_match_the_prompt(rollout: Rollout) -> None:
    prompt = encode_prompts()[:1]
    tail = prompt[0][-2:]
    batch = rollout.generate(
        prompt, SamplingParams(n=2, temperature=0.0, max_tokens=6, stop_sequences=[tail[-1:] * 30])
    )
    assert batch["response_mask"].sum(-1).tolist() == [6, 6]


def test_max_tokens_per_prompt_gives_each_prompt_its_budget(rollout: Rollout) -> None:
    prompts = encode_prompts()
    budgets = [1, 9, 4, 16][: len(prompts)]
    free = rollout.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=3))
    per = rollout.generate(
        prompts, SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=3, max_tokens_per_prompt=budgets)
    )
    lengths = per["response_mask"].sum(-1).tolist()
    assert lengths == [b for b in budgets for _ in range(2)]
    w_free, w_per = free.info["prompt_length"], per.info["prompt_length"]
    for row, budget in enumerate(b for b in budgets for _ in range(2)):
        assert (
            per["input_ids"][row, w_per : w_per + budget].tolist()
            == free["input_ids"][row, w_free : w_free + budget].tolist()
        )
    assert per["finish_reason"] == ["length"] * len(per)


# --------------------------------------------------------------------------- LoRA adapters


def test_hook_update_adapter_refuses_bad_adapters_and_keeps_serving_the_base() -> None:
    r = Rollout(
        RolloutConfig(backend="torch", max_model_len=64, max_lora_rank=4),
        ModelConfig(tiny="qwen2", seed=0),
        EngineContext(role="rollout"),
    )
    try:
        module = "model.layers.0.self_attn.q_proj"
        a, b = torch.ones(4, 128), torch.ones(128, 4)
        config = {"r": 4, "lora_alpha": 8}
        cases = [
            ({f"base_model.model.{module}.lora_A.weight": a}, config, "not both A and B"),
            (
                {f"base_model.model.{module}.lora_A.weight": a, f"base_model.model.{module}.lora_B.weight": b},
                {"r": 8, "lora_alpha": 8},
                "max_lora_rank",
            ),
            (
                {
                    "base_model.model.model.layers.0.nope.lora_A.weight": a,
                    "base_model.model.model.layers.0.nope.lora_B.weight": b,
                },
                config,
                "no module 'model.layers.0.nope'",
            ),
            ({f"base_model.model.{module}.weight": a}, config, "not a LoRA tensor name"),
            (
                {f"base_model.model.{module}.lora_A.weight": a.T, f"base_model.model.{module}.lora_B.weight": b},
                config,
                "needs A",
            ),
        ]
        for tensors, cfg, message in cases:
            with pytest.raises(GeartrainError, match=message):
                r.update_adapter("policy", tensors, cfg)
        batch = r.generate(encode_prompts(), SamplingParams(n=2, max_tokens=6, seed=0))
        expected = teacher_forced_log_probs(tiny_model("qwen2", seed=0), batch)
        assert float((batch["rollout_log_probs"] - expected).abs().max()) < 1e-5  # no half-attached adapter
    finally:
        r.shutdown()
