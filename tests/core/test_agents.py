"""Multi-turn episodes: token-in/token-out rows, loss masks, tool errors, limits and the
asynchronous scheduler, on the real torch rollout over a tiny model."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from geartrain import EngineContext, GeartrainError, ModelConfig, Rollout, RolloutConfig, SamplingParams
from geartrain.agents import (
    CompactFormat,
    EpisodeRunner,
    HermesFormat,
    RunnerLimits,
    StepResult,
    Tool,
    ToolEnvironment,
    chat_bridge,
    episode_batch,
    episode_metrics,
    load_environment,
    schema_of,
)
from geartrain.agents.runner import MIN_TYPICAL_S
from geartrain.batch import Batch
from geartrain.testing.reference import reference_token_outputs
from geartrain.testing.tiny import tiny_model, tiny_tokenizer

MAX_MODEL_LEN = 96
#: a hang guard only: what a wait below takes when the code is right is a few generate calls or
#: tool calls; a runner or tool pool that serialised the work would wait until this runs out and fail
HANG_GUARD_S = 120.0


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def rollout() -> Iterator[Rollout]:
    r = Rollout(
        RolloutConfig(backend="torch", max_model_len=MAX_MODEL_LEN),
        ModelConfig(tiny="qwen2", seed=0),
        EngineContext(role="rollout"),
    )
    yield r
    r.shutdown()


@pytest.fixture(scope="module")
def tok() -> Any:
    return tiny_tokenizer()


class Scripted:
    """Answers every turn with ``obs<k>`` and ends after ``turns`` model turns; the step of
    turn k of episode e sleeps ``delays.get((e, k), 0)`` seconds."""

    def __init__(self, turns: int = 3, delays: dict[tuple[int, int], float] | None = None, obs_len: int = 0) -> None:
        self.turns, self.delays, self.obs_len = turns, delays or {}, obs_len
        self.k = 0
        self.episode = -1

    def reset(self, task: dict[str, Any]) -> str:
        self.episode = int(task["episode"])
        return ""

    def step(self, action: str) -> StepResult:
        self.k += 1
        time.sleep(self.delays.get((self.episode, self.k), 0.0))
        if self.k >= self.turns:
            return StepResult(done=True, reward=0.5)
        return StepResult(observation=f" obs{self.k}{'#' * self.obs_len};", reward=0.25 * self.k)


class Spy:
    """Records what the runner asked of the rollout (a pass-through, not a fake)."""

    def __init__(self, rollout: Rollout) -> None:
        self.rollout = rollout
        self.calls: list[tuple[list[list[int]], SamplingParams, Batch]] = []

    def __call__(self, prompts: list[list[int]], sampling: SamplingParams) -> Batch:
        out = self.rollout.generate(prompts, sampling)
        self.calls.append(([list(p) for p in prompts], sampling, out))
        return out


def prompts_of(tok: Any, n: int) -> list[list[int]]:
    return [[tok.bos_token_id, *tok.encode(f"task {i}:", add_special_tokens=False)] for i in range(n)]


def run(
    rollout: Rollout,
    tok: Any,
    n: int = 4,
    *,
    factory: Any = None,
    limits: RunnerLimits | None = None,
    seed: int = 7,
    **kw: Any,
) -> tuple[list[Any], dict[str, float], Spy]:
    spy = Spy(rollout)
    runner = EpisodeRunner(
        spy,
        tok,
        factory or (lambda: Scripted()),
        limits or RunnerLimits(max_turns=5, max_tokens_per_turn=6, max_model_len=MAX_MODEL_LEN),
        **kw,
    )
    episodes, metrics = runner.run(
        prompts_of(tok, n),
        [{"episode": i} for i in range(n)],
        SamplingParams(temperature=1.0, seed=seed, stop_token_ids=[tok.eos_token_id]),
    )
    return episodes, metrics, spy


# --------------------------------------------------------------------------- token in, token out


def test_three_turn_episode_loss_mask_is_exactly_the_model_tokens(rollout: Rollout, tok: Any) -> None:
    episodes, _, spy = run(rollout, tok, n=3)
    batch = episode_batch(episodes, tok.pad_token_id)
    width = batch.info["prompt_length"]
    sampled: dict[int, list[list[int]]] = {}  # episode -> the ids each of its turns sampled
    for _prompts, sampling, out in spy.calls:
        w = out.info["prompt_length"]
        for row, key in enumerate(sampling.prompt_indices):
            n = int(out["response_mask"][row].sum())
            sampled.setdefault(key // 1024, []).append(out["input_ids"][row, w : w + n].tolist())
    for row, ep in enumerate(episodes):
        assert ep.model_turns == 3 and ep.finish == "done"
        turns = sampled[ep.index]
        obs = [tok.encode(f" obs{k};", add_special_tokens=False) for k in (1, 2)]
        expected_ids = turns[0] + obs[0] + turns[1] + obs[1] + turns[2]
        expected_mask = (
            [1] * len(turns[0]) + [0] * len(obs[0]) + [1] * len(turns[1]) + [0] * len(obs[1]) + [1] * len(turns[2])
        )
        n = len(expected_ids)
        assert batch["input_ids"][row, width : width + n].tolist() == expected_ids
        assert batch["response_mask"][row].tolist() == [0] * width + expected_mask + [0] * (
            batch["input_ids"].shape[1] - width - n
        )
        assert batch["attention_mask"][row, width : width + n].tolist() == [1] * n
        lps = batch["rollout_log_probs"][row, width : width + n]
        assert bool((lps[torch.tensor(expected_mask) == 0] == 0).all())
        # turn rewards sit on the last token of each model turn
        rewards = batch["turn_rewards"][row, width : width + n].tolist()
        ends = [len(turns[0]) - 1, len(turns[0]) + len(obs[0]) + len(turns[1]) - 1, n - 1]
        assert [rewards[i] for i in ends] == [0.25, 0.5, 0.5]
        assert sum(rewards) == pytest.approx(1.25)


def test_observations_are_tokenized_once_and_history_never_retokenized(rollout: Rollout, tok: Any) -> None:
    episodes, _, spy = run(rollout, tok, n=3)
    by_key = {}
    for prompts, sampling, out in spy.calls:
        w = out.info["prompt_length"]
        for row, key in enumerate(sampling.prompt_indices):
            n = int(out["response_mask"][row].sum())
            by_key[key] = (prompts[row], out["input_ids"][row, w : w + n].tolist())
    for ep in episodes:
        history = list(ep.prompt_ids)
        for k in range(ep.model_turns):
            prompt, sampled = by_key[ep.index * 1024 + k]
            assert prompt == history  # the next turn's prompt is exactly the ids so far
            history += sampled
            if k < 2:
                history += tok.encode(f" obs{k + 1};", add_special_tokens=False)
        assert ep.token_ids() == history


def test_trainer_log_probs_of_an_episode_equal_the_rollouts(rollout: Rollout, tok: Any) -> None:
    episodes, _, _ = run(rollout, tok, n=4)
    batch = episode_batch(episodes, tok.pad_token_id)
    reference = reference_token_outputs(tiny_model("qwen2", seed=0), batch)["log_probs"]
    mask = batch["response_mask"].bool()
    assert int(mask.sum()) > 20
    err = float((reference - batch["rollout_log_probs"])[mask].abs().max())
    assert err < 1e-5, err


def test_episodes_do_not_depend_on_what_they_were_batched_with(rollout: Rollout, tok: Any) -> None:
    """Placement invariance: all 4 episodes in one runner (one rank) or 2 + 2 (two ranks)."""
    whole, _, _ = run(rollout, tok, n=4)
    runner = EpisodeRunner(
        rollout.generate,
        tok,
        lambda: Scripted(),
        RunnerLimits(max_turns=5, max_tokens_per_turn=6, max_model_len=MAX_MODEL_LEN),
    )
    prompts = prompts_of(tok, 4)
    split = []
    for part in ([0, 1], [2, 3]):
        eps, _ = runner.run(
            [prompts[i] for i in part],
            [{"episode": i} for i in part],
            SamplingParams(temperature=1.0, seed=7, stop_token_ids=[tok.eos_token_id]),
            episode_indices=part,
        )
        split += eps
    assert [e.token_ids() for e in split] == [e.token_ids() for e in whole]


# --------------------------------------------------------------------------- limits


@pytest.mark.parametrize("obs_len", [6, 20], ids=["in-a-model-turn", "by-an-observation"])
def test_an_episode_hitting_its_token_budget_is_truncated_and_marked(rollout: Rollout, tok: Any, obs_len: int) -> None:
    limits = RunnerLimits(max_turns=5, max_tokens_per_turn=6, max_episode_tokens=20, max_model_len=MAX_MODEL_LEN)
    episodes, _, _ = run(rollout, tok, n=3, factory=lambda: Scripted(turns=5, obs_len=obs_len), limits=limits)
    for ep in episodes:
        assert ep.truncated and ep.finish == "truncated"
        assert ep.used <= 20
    batch = episode_batch(episodes, tok.pad_token_id)
    assert batch["finish_reason"] == ["length"] * 3
    assert episode_metrics(batch["episode"])["agent/truncated"] == 3.0


def test_max_turns_ends_the_episode_without_the_last_observation(rollout: Rollout, tok: Any) -> None:
    limits = RunnerLimits(max_turns=2, max_tokens_per_turn=4, max_model_len=MAX_MODEL_LEN)
    episodes, _, _ = run(rollout, tok, n=2, factory=lambda: Scripted(turns=9), limits=limits)
    for ep in episodes:
        assert ep.finish == "max_turns" and not ep.truncated
        assert [s.kind for s in ep.segments] == ["model", "observation", "model"]


def test_an_environment_that_raises_ends_only_its_episode(rollout: Rollout, tok: Any) -> None:
    class Broken(Scripted):
        def step(self, action: str) -> StepResult:
            if self.episode == 1:
                raise RuntimeError("boom")
            return super().step(action)

    episodes, _, _ = run(rollout, tok, n=3, factory=Broken)
    assert [e.finish for e in episodes] == ["done", "error", "done"]
    assert "boom" in (episodes[1].error or "")


# --------------------------------------------------------------------------- asynchronous scheduling


class SlowUntilTheOthersFinish(Scripted):
    """Episode 0's first step does not return before every other episode has ended (or the
    hang guard ran out: ``released`` says which): a round-synchronous runner never gets there."""

    def __init__(self, n: int, turns: int, released: list[bool], ended: list[int], others_done: threading.Event):
        super().__init__(turns=turns)
        self.n, self.released, self.ended, self.others_done = n, released, ended, others_done

    def step(self, action: str) -> StepResult:
        result = super().step(action)
        if self.episode == 0 and self.k == 1:
            self.released.append(self.others_done.wait(HANG_GUARD_S))
        elif self.episode != 0 and result.done:
            self.ended.append(self.episode)
            if len(self.ended) == self.n - 1:
                self.others_done.set()
        return result


def test_a_slow_step_holds_only_its_own_episode(rollout: Rollout, tok: Any) -> None:
    """By the order of events, not by timing two runs: while episode 0's first step is still
    running, the other episodes go through all their turns (a round-synchronous runner would
    wait on it every turn: turns x the slow step)."""
    turns, n = 4, 4
    released: list[bool] = []
    ended: list[int] = []
    others_done = threading.Event()
    limits = RunnerLimits(max_turns=turns, max_tokens_per_turn=4, max_model_len=MAX_MODEL_LEN)

    def factory() -> Scripted:
        return SlowUntilTheOthersFinish(n, turns, released, ended, others_done)

    episodes, metrics, _ = run(rollout, tok, n=n, factory=factory, limits=limits)
    assert released == [True], "the other episodes waited for episode 0's slow step"
    assert sorted(ended) == [1, 2, 3] and all(e.model_turns == turns for e in episodes)
    assert metrics["agent/generate_calls"] > turns  # episodes went on without the slow one


def test_fast_steps_are_batched_into_one_generation(rollout: Rollout, tok: Any) -> None:
    # the runner waits batch_wait x a typical step (>= MIN_TYPICAL_S) for the steps still running
    # to join a call; at the default (0.1 x ~10-100 ms) six thread steps on a loaded machine split
    # the call. Here the wait is a hang guard (ALL_COMPLETED ends it as soon as the six are done),
    # so the test shows the batching, not the machine's speed
    wait = HANG_GUARD_S / MIN_TYPICAL_S
    episodes, metrics, _ = run(rollout, tok, n=6, factory=lambda: Scripted(turns=3), batch_wait=wait)
    assert metrics["agent/generate_calls"] == 3 and metrics["agent/episodes_per_call"] == 6


# --------------------------------------------------------------------------- tools


def test_tool_errors_become_counted_observations() -> None:
    def boom(x: str) -> str:
        raise ValueError("bad input")

    finished, release = threading.Event(), threading.Event()

    def slow(x: str) -> str:
        release.wait()  # until the test ends: the step's timeout, not a race with a sleep, ends it
        finished.set()
        return "late"

    def calc(expression: str) -> str:
        return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - test input only

    # calc and boom return well within the hang guard, however loaded the machine; the hung call
    # runs under the 1 s timeout the test is about
    env = ToolEnvironment([boom, slow, calc], call_format="compact", timeout_s=HANG_GUARD_S)
    ok = env.step("[calc 12*3]")
    assert ok.observation == "(36)" and ok.info["tool_errors"] == 0 and not ok.done
    raised = env.step("[boom 1]")
    assert raised.observation == "(error: ValueError: bad input)" and raised.info["tool_errors"] == 1
    try:
        hung = ToolEnvironment([slow], call_format="compact", timeout_s=1.0).step("[slow 1]")
        assert not finished.is_set()  # the step ended at the tool's timeout, before the tool returned
    finally:
        release.set()
    assert hung.observation == "(error: timed out after 1.0s)" and hung.info["tool_errors"] == 1
    malformed = env.step("[calc 1+")
    assert malformed.info["tool_errors"] == 1 and "malformed" in str(malformed.observation)
    unknown = env.step("[nope 1]")
    assert "unknown tool 'nope'" in str(unknown.observation) and unknown.info["tool_errors"] == 1
    final = env.step("36")
    assert final.done and final.info["tool_calls"] == 0
    records = [
        {
            "model_turns": 1,
            "tool_calls": s.info["tool_calls"],
            "tool_errors": s.info["tool_errors"],
            "tool_latencies_s": s.info["tool_latencies_s"],
            "truncated": False,
            "finish": "done",
            "model_tokens": 1,
            "observation_tokens": 1,
        }
        for s in (ok, raised, hung, malformed, unknown)
    ]
    m = episode_metrics(records)
    assert m["agent/tool_calls"] == 5 and m["agent/tool_errors"] == 4
    assert m["agent/tool_success_rate"] == pytest.approx(0.2)
    assert m["agent/tool_latency_p95_s"] >= 1.0


def test_hermes_calls_run_concurrently_and_bad_json_is_an_error() -> None:
    together = threading.Barrier(3)

    def wait(seconds: float) -> str:
        # returns only once all three calls of the step are running at the same time (by the
        # order of events; the barrier's timeout is a hang guard for calls run one after another)
        together.wait(timeout=HANG_GUARD_S)
        return "ok"

    env = ToolEnvironment([wait], call_format="hermes", timeout_s=2 * HANG_GUARD_S)
    call = '<tool_call>{"name": "wait", "arguments": {"seconds": 0.5}}</tool_call>'
    out = env.step(call * 3)
    assert out.info["tool_calls"] == 3 and out.info["tool_errors"] == 0, out.observation
    assert out.observation == "<tool_response>\nok\n</tool_response>\n" * 3
    bad = env.step('<tool_call>{"name": "wait", "arguments": {"seconds": </tool_call>')
    assert bad.info["tool_errors"] == 1 and "not valid JSON" in str(bad.observation)
    missing = env.step('<tool_call>{"name": "wait", "arguments": {}}</tool_call>')
    assert "needs argument 'seconds'" in str(missing.observation)


def test_schema_from_the_signature() -> None:
    def f(a: int, b: str = "x", c: float | None = None, d: list[int] | None = None) -> str:
        """Doc."""
        return ""

    assert schema_of(f) == {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "string"},
            "c": {"type": "number"},
            "d": {"type": "array"},
        },
        "required": ["a"],
    }
    assert Tool(fn=f).spec()["function"]["description"] == "Doc."


def test_formats_stop_texts_and_parsing() -> None:
    assert CompactFormat().parse("[calc 2*3]")[0][0].positional == "2*3"
    assert CompactFormat().parse("42") == ([], [])
    assert HermesFormat().stop_texts() == ["</tool_call>"]


def test_chat_bridge_is_the_template_text_between_assistant_turns(tok: Any) -> None:
    assert chat_bridge(tok, ["36"]) == "\ntool: 36\nassistant: "


def test_load_environment_from_a_file_relative_to_the_job(tmp_path: Any) -> None:
    (tmp_path / "my_env.py").write_text(
        "from geartrain.agents import Environment, StepResult\n"
        "class Echo(Environment):\n"
        "    def __init__(self, tag='x'):\n        self.tag = tag\n"
        "    def step(self, action):\n        return StepResult(observation=self.tag + action, done=True)\n"
    )
    env = load_environment("my_env.py:Echo", kwargs={"tag": "!"}, base_dir=str(tmp_path))()
    assert env.step("a").observation == "!a"
    with pytest.raises(GeartrainError, match="does not exist"):
        load_environment("missing.py:Echo", base_dir=str(tmp_path))
    with pytest.raises(GeartrainError, match="not a built-in environment"):
        load_environment("calculator")
    assert isinstance(load_environment("tools", kwargs={"call_format": "compact"})(), ToolEnvironment)


def test_chat_template_observations_are_the_bridge_tokens_all_masked(rollout: Rollout, tok: Any) -> None:
    episodes, _, _ = run(rollout, tok, n=2, chat_template=True, observation_role="tool")
    for ep in episodes:
        observations = [s for s in ep.segments if s.kind == "observation"]
        assert [s.ids for s in observations] == [
            tok.encode(f"\ntool:  obs{k};\nassistant: ", add_special_tokens=False) for k in (1, 2)
        ]
    batch = episode_batch(episodes, tok.pad_token_id)
    width = batch.info["prompt_length"]
    for row, ep in enumerate(episodes):
        assert batch["response_mask"][row, width : width + ep.used].tolist() == ep.response_mask()
        assert sum(ep.response_mask()) == sum(len(s.ids) for s in ep.segments if s.kind == "model")


def test_a_tool_environment_may_set_its_own_stop_texts() -> None:
    """``stop_texts`` is an environment's documented attribute: a ToolEnvironment subclass
    that sets it (a closing tag of its own) keeps it, chat or not; it raised AttributeError
    since ``stop_texts`` became a read-only property."""

    class Answering(ToolEnvironment):
        def __init__(self) -> None:
            super().__init__([], call_format="hermes")
            self.stop_texts = ["</tool_call>", "</answer>"]

    env = Answering()
    assert env.stop_texts == ["</tool_call>", "</answer>"]
    env.chat = True
    assert env.stop_texts == ["</tool_call>", "</answer>"]
    assert ToolEnvironment([], call_format="hermes").stop_texts == ["</tool_call>"]  # the format's otherwise
