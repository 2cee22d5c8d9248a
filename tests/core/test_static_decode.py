"""The torch rollout's static-cache decode (:mod:`geartrain.rollouts.static_decode`), the
CUDA path, run on CPU: eager here, compiled into CUDA graphs only on CUDA. It must equal the
dynamic loop: same tokens, log-probs within float rounding, the same stop rules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from geartrain import EngineContext, ModelConfig, Rollout, RolloutConfig, SamplingParams
from geartrain.rollouts import static_decode
from geartrain.testing import RolloutConformance
from geartrain.testing.rollout_suite import encode_prompts


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class TestStaticCacheRollout(RolloutConformance):
    """The whole rollout contract through the static path (small chunks too)."""

    backend = "torch"
    options = {"max_batch_size": 16, "static_cache": True}


def make_rollout(family: str, static: bool) -> Rollout:
    return Rollout(
        RolloutConfig(backend="torch", max_model_len=64, options={"static_cache": static}),
        ModelConfig(tiny=family, seed=0),
        EngineContext(role="rollout"),
    )


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(n=3, temperature=0.9, top_p=0.9, max_tokens=12, seed=4),
        SamplingParams(n=2, temperature=0.0, max_tokens=10, seed=0, stop_token_ids=[40, 41, 42]),
        SamplingParams(
            n=4,
            temperature=1.0,
            max_tokens=12,
            seed=1,
            stop_sequences=[[50, 51], [60]],
            max_tokens_per_prompt=[3, 12, 7, 1],
        ),
    ],
    ids=["top_p", "greedy_stop_tokens", "stop_sequences_budgets"],
)
def test_static_decode_equals_the_dynamic_loop(
    family: str, sampling: SamplingParams, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real = static_decode.decode_chunk_static
    monkeypatch.setattr(static_decode, "decode_chunk_static", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = encode_prompts()[:4]
    dyn, sta = make_rollout(family, False), make_rollout(family, True)
    try:
        a = dyn.generate(prompts, sampling)
        assert not calls
        b = sta.generate(prompts, sampling)
        assert calls  # the static path really ran
    finally:
        dyn.shutdown()
        sta.shutdown()
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert torch.equal(a["response_mask"], b["response_mask"])
    assert a.meta["finish_reason"] == b.meta["finish_reason"]
    err = float((a["rollout_log_probs"] - b["rollout_log_probs"]).abs().max())
    assert err < 1e-5, err


def test_decode_step_is_compiled_only_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Linear(2, 2)
    assert static_decode.decode_step(model, torch.device("cpu")) == model.forward
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    monkeypatch.setattr(static_decode, "_COMPILED", {})
    first = static_decode.decode_step(model, torch.device("cuda"))
    assert static_decode.decode_step(model, torch.device("cuda")) is first  # compiled once per model
    assert calls == [{"mode": "reduce-overhead", "fullgraph": False}]


def test_static_cache_buffers_are_reused_across_calls_and_freed_by_release() -> None:
    # the compiled decode step's CUDA graphs read the cache buffers: same addresses each call
    ro = make_rollout("qwen2", True)
    try:
        sp = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=0)
        first = ro.generate(encode_prompts()[:3], sp)
        model = ro.handle.model
        caches = dict(model._geartrain_static_caches)

        def pointers(caches: dict) -> dict:
            return {k: [layer.keys.data_ptr() for layer in c.layers] for k, c in caches.items()}

        before = pointers(caches)
        again = ro.generate(encode_prompts()[:3], sp)
        assert torch.equal(first["input_ids"], again["input_ids"])  # reset: no state leaks between calls
        assert pointers(model._geartrain_static_caches) == before
        ro.release()
        assert not hasattr(model, "_geartrain_static_caches")
    finally:
        ro.shutdown()


STOPPING = SamplingParams(
    n=3, temperature=1.0, max_tokens=12, seed=1, stop_sequences=[[50, 51], [60]], max_tokens_per_prompt=[3, 12, 7, 1]
)


def _static_equals_dynamic(sampling: SamplingParams) -> list[int]:
    """Generate with the dynamic loop and the static path (as patched by the caller); assert
    the same tokens, stops and log-probs; return the static run's response lengths."""
    prompts = encode_prompts()[:4]
    dyn, sta = make_rollout("qwen2", False), make_rollout("qwen2", True)
    try:
        a, b = dyn.generate(prompts, sampling), sta.generate(prompts, sampling)
    finally:
        dyn.shutdown()
        sta.shutdown()
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert a.meta["finish_reason"] == b.meta["finish_reason"]
    assert float((a["rollout_log_probs"] - b["rollout_log_probs"]).abs().max()) < 1e-5
    return b["response_mask"].sum(1).tolist()


class _EagerReplay:
    """Stands in for the captured CUDA graph on a CPU: a replay runs the captured step."""

    def __init__(self, state: static_decode._StepState) -> None:
        self.state, self.replays = state, 0

    def replay(self) -> None:
        self.replays += 1
        self.state.advance()


def test_the_step_graph_loop_replays_one_step_per_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_graph = "step": the warm-up runs step 1, the capture runs nothing, and each
    replay is one token; the tokens equal the dynamic loop's."""
    graphs: list[_EagerReplay] = []

    def capture(state: static_decode._StepState) -> _EagerReplay:
        state.advance()  # what _capture's warm-up on the side stream does
        graphs.append(_EagerReplay(state))
        return graphs[-1]

    monkeypatch.setattr(static_decode, "graph_mode", lambda requested, model, device: "step")
    monkeypatch.setattr(static_decode, "_capture", capture)
    lengths = _static_equals_dynamic(STOPPING)
    assert len(graphs) == 1
    assert graphs[0].replays == max(lengths) - 2  # token 0 from the prefill, token 1 from the warm-up


def test_a_failed_capture_decodes_on_and_later_calls_use_the_forward_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    def capture(state: static_decode._StepState) -> None:
        state.advance()  # the warm-up ran; the capture failed
        return None

    monkeypatch.setattr(static_decode, "_STEP_GRAPH_FAILED", set())
    monkeypatch.setattr(static_decode, "graph_mode", lambda requested, model, device: "step")
    monkeypatch.setattr(static_decode, "_capture", capture)
    _static_equals_dynamic(STOPPING)
    assert len(static_decode._STEP_GRAPH_FAILED) == 1  # the model is remembered: graph_mode gives "forward"


def test_the_decode_step_reads_nothing_back_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA graph cannot hold a host read (``.item()``, ``bool(tensor)``, a data-dependent
    branch): the whole step (forward, sampling, stop rules) must trace as one graph."""
    traced = torch.compile(static_decode._StepState.advance, backend="eager", fullgraph=True)
    monkeypatch.setattr(static_decode._StepState, "advance", lambda self: traced(self))
    _static_equals_dynamic(
        SamplingParams(
            n=2,
            temperature=0.9,
            top_p=0.9,
            top_k=20,
            max_tokens=6,
            seed=3,
            stop_token_ids=[40],
            stop_sequences=[[50, 51]],
        )
    )


def test_graph_mode_defaults_and_fallback() -> None:
    model = torch.nn.Linear(1, 1)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert static_decode.graph_mode("step", model, cpu) == "none"  # graphs only on CUDA
    assert static_decode.graph_mode(None, model, cuda) == "forward"
    assert static_decode.graph_mode("step", model, cuda) == "step"
    static_decode._STEP_GRAPH_FAILED.add(id(model))
    try:
        assert static_decode.graph_mode("step", model, cuda) == "forward"
    finally:
        static_decode._STEP_GRAPH_FAILED.discard(id(model))


class _Event:
    """Stands in for a CUDA event: ``done`` says whether the GPU has reached it."""

    done = False

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        pass


class _ReachedEvent(_Event):
    done = True


@pytest.mark.parametrize(("event", "extra_steps"), [(_Event, static_decode.STEPS_IN_FLIGHT - 1), (_ReachedEvent, 0)])
def test_the_host_learns_every_row_is_done_within_the_steps_in_flight(event: type, extra_steps: int) -> None:
    """A GPU far behind the host (events never reached until waited on): the host enqueues
    at most STEPS_IN_FLIGHT - 1 steps past the one that finished every row, then stops;
    a GPU that keeps up: the host stops right after that step."""
    flag = torch.tensor(False)
    watch = static_decode._DoneWatch(flag, deferred=True, event=event)
    steps = 0
    for _ in range(100):
        if watch.finished():
            break
        steps += 1
        if steps == 10:
            flag.fill_(True)
        watch.post()
    assert steps == 10 + extra_steps


def test_compacting_finished_rows_keeps_every_rows_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 33 item 3: with compact_every = 2 the static decode goes on with the live rows
    only once at most half are live (length-skewed budgets, stop sequences); every row's
    tokens, stops and log-probs are the dynamic loop's, and the compacted batches shrink."""
    sizes: list[int] = []
    real = static_decode._compact

    def spy(model, state, keep, filled, max_len):  # noqa: ANN001, ANN202
        sizes.append(len(keep))
        new = real(model, state, keep, filled, max_len)
        assert int(new.cache.layers[0].cumulative_length) == filled  # the next token lands after them
        return new

    monkeypatch.setattr(static_decode, "_compact", spy)
    real_decode = static_decode.decode_chunk_static
    monkeypatch.setattr(
        static_decode, "decode_chunk_static", lambda *a, **k: real_decode(*a, **{**k, "compact_every": 2})
    )
    lengths = _static_equals_dynamic(STOPPING)
    assert sizes and sizes == sorted(sizes, reverse=True) and sizes[0] <= len(lengths) // 2, sizes
    assert max(lengths) > 2 * min(lengths)  # the budgets skew the lengths


def test_a_sampler_that_fails_to_compile_is_tried_once_then_sampled_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode loop holds the function :func:`static_decode.sampler` returned for its whole
    chunk: after one failed compile it must sample eagerly, not compile again at every token
    (seen on an H200 with torch 2.11: minutes of retries)."""
    from geartrain.rollouts.fused_sampler import sample_with_log_prob

    attempts = []

    def failing_compile(fn, **_):
        def compiled(*args):
            attempts.append(len(args))
            raise RuntimeError("inductor: list indices must be integers or slices, not NoneType")

        return compiled

    monkeypatch.setattr(static_decode, "_SAMPLER", {})
    monkeypatch.setattr(static_decode.torch, "compile", failing_compile)
    choose = static_decode.sampler(torch.device("cuda"))
    logits = torch.randn(3, 11)
    sampling = SamplingParams(temperature=0.9)
    seeds = torch.tensor([1, 2, 3])
    with pytest.warns(UserWarning, match="could not be compiled"):
        first = choose(logits, sampling, seeds, 0)
    later = [choose(logits, sampling, seeds, step) for step in range(1, 4)]
    assert len(attempts) == 1
    for step, (tokens, log_probs) in enumerate([first, *later]):
        want_tokens, want_log_probs = sample_with_log_prob(logits, sampling, seeds, step)
        assert torch.equal(tokens, want_tokens) and torch.equal(log_probs, want_log_probs)
    assert static_decode.sampler(torch.device("cuda")) is sample_with_log_prob
