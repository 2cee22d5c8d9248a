"""What an agent environment may return, and what the runner and the data path do with it.

* a ``reset`` / ``StepResult`` field of the wrong type, or a non-finite reward, ends only
  its own episode with an error naming the field (it once crashed the whole rollout with an
  anonymous ``TypeError``, or trained on the NaN);
* an episode whose last turn used its last token is truncated, never sent to the rollout
  with a budget of 0 tokens;
* a tool environment's tool specs reach the prompt's chat template (``tools=``);
* an environment failing every episode is logged with its traceback, not silent;
* a first observation (from ``reset``) under the chat template takes the generation prompt's place;
* a turn that ended on the template's end-of-turn token (EOS) is not followed by a second one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from geartrain import EngineContext, ModelConfig, Rollout, RolloutConfig, SamplingParams
from geartrain.agents import EpisodeRunner, RunnerLimits, StepResult, episode_batch
from geartrain.agents.runner import episode_metrics
from geartrain.char_tokenizer import CHAT_TEMPLATE
from geartrain.testing.tiny import tiny_tokenizer
from geartrain.trainer.config import TrainConfig
from geartrain.trainer.preflight import preflight

MAX_MODEL_LEN = 64


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


def run_episodes(
    rollout: Rollout, tok: Any, factory: Any, limits: RunnerLimits, n: int = 2, **sampling: Any
) -> tuple[list[Any], list[list[int]]]:
    """``n`` episodes; also the per-prompt budgets of every generate call."""
    budgets: list[list[int]] = []

    def generate(prompts: list[list[int]], params: SamplingParams) -> Any:
        budgets.append(list(params.max_tokens_per_prompt or []))
        return rollout.generate(prompts, params)

    runner = EpisodeRunner(generate, tok, factory, limits)
    prompts = [[tok.bos_token_id, *tok.encode(f"task {i}:", add_special_tokens=False)] for i in range(n)]
    params = {"temperature": 1.0, "seed": 7, "stop_token_ids": [tok.eos_token_id], **sampling}
    episodes, _ = runner.run(prompts, [{"i": i} for i in range(n)], SamplingParams(**params))
    return episodes, budgets


class _Env:
    """Base: no first observation; ``step`` is given by the subclass."""

    def reset(self, task: dict[str, Any]) -> Any:
        return ""


class GymReset(_Env):
    """Gymnasium's ``reset`` returns ``(observation, info)``: a natural port."""

    def reset(self, task: dict[str, Any]) -> Any:
        return ("hello", {})

    def step(self, action: str) -> StepResult:
        return StepResult(done=True)


class NoneReward(_Env):
    def step(self, action: str) -> StepResult:
        return StepResult(reward=None, done=True)  # type: ignore[arg-type]


class IntObservation(_Env):
    def step(self, action: str) -> StepResult:
        return StepResult(observation=42)  # type: ignore[arg-type]


class NanReward(_Env):
    def step(self, action: str) -> StepResult:
        return StepResult(reward=float("nan"), done=True)


LIMITS = RunnerLimits(max_turns=3, max_tokens_per_turn=4, max_model_len=MAX_MODEL_LEN)


@pytest.mark.parametrize(
    ("env", "field"),
    [(GymReset, "reset"), (NoneReward, "reward"), (IntObservation, "observation")],
    ids=["gym-style-reset-tuple", "reward-None", "observation-int"],
)
def test_an_environment_returning_a_bad_type_ends_its_episode_naming_the_field(
    rollout: Rollout, tok: Any, env: type, field: str
) -> None:
    """Today each raises a bare TypeError out of ``EpisodeRunner.run`` (the whole step,
    every episode of it, and the run are lost) instead of ending the episode with an
    error that names the field, as a ``step`` that returns a non-StepResult does."""
    episodes, _ = run_episodes(rollout, tok, env, LIMITS)
    for ep in episodes:
        assert ep.finish == "error"
        assert field in (ep.error or ""), ep.error


def test_a_non_finite_environment_reward_is_refused_not_trained_on(rollout: Rollout, tok: Any) -> None:
    """A reward function's non-finite score is an error (reward 0, counted); an
    environment's NaN turn reward goes straight into ``turn_rewards`` today, and from there
    into the whole GRPO group's advantages."""
    episodes, _ = run_episodes(rollout, tok, NanReward, LIMITS)
    batch = episode_batch(episodes, tok.pad_token_id)
    assert bool(torch.isfinite(batch["turn_rewards"]).all()), batch["turn_rewards"]
    for ep in episodes:
        assert ep.finish == "error" and "reward" in (ep.error or ""), (ep.finish, ep.error)


class GoOnSilently(_Env):
    """Goes on without anything to show (e.g. 'think more')."""

    def step(self, action: str) -> StepResult:
        return StepResult(observation="")


def test_an_episode_with_no_room_left_is_truncated_not_sent_with_a_zero_budget(rollout: Rollout, tok: Any) -> None:
    """Every token stops a turn, so each turn is one token that finishes with ``stop``; the
    second one uses the episode's last token. The environment goes on with no observation:
    today the runner asks the rollout for a third turn with a budget of 0 (against
    ``SamplingParams.max_tokens_per_prompt``'s contract, ``>= 1``) and the torch rollout
    raises ``sampling.max_tokens must be >= 1, got 0``, ending the run."""
    limits = RunnerLimits(max_turns=5, max_tokens_per_turn=1, max_episode_tokens=2, max_model_len=MAX_MODEL_LEN)
    episodes, budgets = run_episodes(rollout, tok, GoOnSilently, limits, n=1, stop_token_ids=list(range(len(tok))))
    assert all(b >= 1 for call in budgets for b in call), budgets
    (ep,) = episodes
    assert ep.used == 2 and ep.model_turns == 2
    assert ep.truncated and ep.finish == "truncated"


TOOLS_TEMPLATE = (
    "{% if tools %}system: tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
    + CHAT_TEMPLATE
)


def test_a_tool_environments_specs_reach_the_prompts_chat_template(tmp_path: Path, monkeypatch: Any) -> None:
    """docs/agents.md: "env.tools lists them as OpenAI/Hermes function specs for a chat
    template", and maps TRL's GRPOTrainer(tools=[...]) to a ToolEnvironment with
    chat_template = true. TRL (and verl) render the prompt with ``tools=``; geartrain's
    data path calls ``apply_chat_template(messages, add_generation_prompt=True)`` without
    them, so the model is never told which tools exist or their arguments."""
    (tmp_path / "review_tools_mod.py").write_text(
        'def multiply(a: int, b: int) -> int:\n    """Multiply two integers."""\n    return a * b\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    tok = tiny_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    assert "multiply" in tok.apply_chat_template(
        [{"role": "user", "content": "x"}],
        tools=[{"type": "function", "function": {"name": "multiply"}}],
        tokenize=False,
    )  # the template does render tools when given them
    config = TrainConfig.model_validate(
        {
            "model": {"tiny": "qwen2"},
            "reward": {"function": "arithmetic"},
            "data": {"apply_chat_template": True, "max_prompt_length": 64, "batch_size": 1},
            "rollout": {
                "max_model_len": 128,
                "agent": {
                    "environment": "tools",
                    "environment_kwargs": {"tools": ["review_tools_mod:multiply"], "call_format": "hermes"},
                    "chat_template": True,
                },
            },
        }
    )
    pre = preflight(config, tokenizer=tok, data=[{"prompt": "12*3=", "ground_truth": "36"}])
    (row,) = pre.datasets["data.path"].rows
    assert "multiply" in row.prompt, row.prompt


class Greets(_Env):
    """A first observation at reset (docs/agents.md: "a first observation after the prompt")."""

    def reset(self, task: dict[str, Any]) -> str:
        return "hi"

    def step(self, action: str) -> StepResult:
        return StepResult(done=True)


def test_a_first_observation_under_the_chat_template_adds_no_empty_assistant_turn(rollout: Rollout, tok: Any) -> None:
    """The reset observation comes after the task prompt, which already ends with the
    generation prompt (``assistant: ``); rendered as the bridge after an assistant turn it
    read ``user: 1+1=\\nassistant: \\ntool: hi\\nassistant: `` (an empty assistant turn the
    template never produces). It takes the generation prompt's place instead."""
    prompt_text = tok.apply_chat_template(
        [{"role": "user", "content": "1+1="}], add_generation_prompt=True, tokenize=False
    )
    runner = EpisodeRunner(rollout.generate, tok, Greets, LIMITS, chat_template=True)
    episodes, _ = runner.run(
        [tok.encode(prompt_text, add_special_tokens=False)],
        [{}],
        SamplingParams(temperature=1.0, seed=7, stop_token_ids=[tok.eos_token_id]),
    )
    (ep,) = episodes
    first = ep.segments[0]
    assert first.kind == "observation"
    context = tok.decode(ep.prompt_ids + first.ids)
    expected = tok.apply_chat_template(
        [{"role": "user", "content": "1+1="}, {"role": "tool", "content": "hi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert context == expected, (context, expected)


def test_an_environment_failing_every_episode_is_reported_not_silent(
    rollout: Rollout, tok: Any, tmp_path: Path, caplog: Any
) -> None:
    """An environment bug (here ``reset`` reads a column the data does not have) ends every
    episode with ``finish = "error"``. Today nothing is logged: the exception text lives
    only in ``meta["episode"]["error"]``; ``geartrain train`` of the calculator job with
    such an environment ran 6 steps on empty episodes, printed only the watchdog's "the
    reward is constant on these prompts", exported the policy and exited 0. A reward
    function's first failure is logged with its traceback (geartrain.rewards); an
    environment's should be too."""
    from geartrain.agents import AgentConfig
    from geartrain.data import PromptBatch, PromptRow
    from geartrain.trainer.episodes import episode_prompt_batch, run_episode_share

    (tmp_path / "bad_env.py").write_text(
        "from geartrain.agents import StepResult\n"
        "class Env:\n"
        "    def reset(self, task):\n        return task['answer']\n"
        "    def step(self, action):\n        return StepResult(done=True)\n"
    )
    rows = [
        PromptRow(
            prompt_ids=[tok.bos_token_id, *tok.encode("2*3=", add_special_tokens=False)],
            prompt="2*3=",
            ground_truth="6",
        )
    ]
    share = episode_prompt_batch(PromptBatch(rows=rows, indices=[0], epoch=0))
    agent = AgentConfig(environment=str(tmp_path / "bad_env.py") + ":Env", max_turns=2, max_tokens_per_turn=4)
    sampling = SamplingParams(n=2, temperature=1.0, seed=3, stop_token_ids=[tok.eos_token_id])
    with caplog.at_level("WARNING"):
        batch, _ = run_episode_share(rollout.generate, tok, share, sampling, agent, base_dir=None, max_model_len=48)
    assert [r["finish"] for r in batch["episode"]] == ["error", "error"]
    logged = "\n".join(r.getMessage() + (str(r.exc_info[1]) if r.exc_info else "") for r in caplog.records)
    assert "KeyError" in logged and "answer" in logged, logged


#: A template whose turns end with the EOS token, as Qwen's (<|im_end|>) and Llama 3's (<|eot_id|>) do.
EOS_TURN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


class Feedback(_Env):
    """verl's BaseInteraction as docs/agents.md maps it: feedback after every turn."""

    def step(self, action: str) -> StepResult:
        return StepResult(observation="try again")


def test_a_turn_ended_by_eos_is_not_followed_by_a_second_end_of_turn_token() -> None:
    """Under ``chat_template = true`` the observation is the template's bridge from the end
    of an assistant turn's *content*: it starts with the end-of-turn token. A model turn
    that ends by emitting EOS (= the end-of-turn token of Qwen/Llama-3 templates) already
    holds that token, so today the episode reads ``...</s></s>\\ntool: try again</s>...``:
    a doubled end-of-turn the template never produces, trained on as context."""
    tok = tiny_tokenizer()
    tok.chat_template = EOS_TURN_TEMPLATE
    eos = tok.eos_token_id
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "2+2="}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    limits = RunnerLimits(max_turns=3, max_tokens_per_turn=60, max_model_len=256)
    rollout = Rollout(
        RolloutConfig(backend="torch", max_model_len=256),
        ModelConfig(tiny="qwen2", seed=0),
        EngineContext(role="rollout"),
    )
    try:
        runner = EpisodeRunner(rollout.generate, tok, Feedback, limits, chat_template=True)
        sampling = SamplingParams(temperature=1.0, seed=0, stop_token_ids=[eos])
        episodes, _ = runner.run([prompt] * 8, [{}] * 8, sampling)
    finally:
        rollout.shutdown()
    ended_by_eos = [
        ep.segments[k].ids[-1] == eos
        for ep in episodes
        for k in range(len(ep.segments) - 1)
        if ep.segments[k].kind == "model" and ep.segments[k + 1].kind == "observation"
    ]
    assert any(ended_by_eos)  # the case occurs with this seed
    for ep in episodes:
        ids = ep.token_ids()
        doubled = [i for i in range(len(ids) - 1) if ids[i] == ids[i + 1] == eos]
        assert not doubled, tok.decode(ids[len(prompt) :])


RELEASE = threading.Event()


class HangsOnItsTask(_Env):
    """``step`` blocks (until the test releases it) on the task marked ``hang``."""

    def reset(self, task: dict[str, Any]) -> str:
        self.hang = bool(task.get("hang"))
        return ""

    def step(self, action: str) -> StepResult:
        if self.hang:
            RELEASE.wait()
        return StepResult(reward=1.0, done=True)


def test_an_environment_step_past_its_timeout_ends_only_its_own_episode(rollout: Rollout, tok: Any) -> None:
    """A ``step`` that hangs ends its episode as an error at ``step_timeout_s``; the run
    returns while that step is still blocked (without the limit it would wait forever)."""
    RELEASE.clear()
    runner = EpisodeRunner(rollout.generate, tok, HangsOnItsTask, LIMITS, step_timeout_s=0.5)
    prompts = [[tok.bos_token_id, *tok.encode(f"task {i}:", add_special_tokens=False)] for i in range(2)]
    try:
        episodes, _ = runner.run(
            prompts, [{"hang": False}, {"hang": True}], SamplingParams(temperature=1.0, seed=7, max_tokens=4)
        )
        assert not RELEASE.is_set()  # returned while the hung step still runs
    finally:
        RELEASE.set()
    ok, hung = episodes
    assert ok.finish == "done" and ok.error is None
    assert hung.finish == "error"
    assert "step took longer than 0.5 s (rollout.agent.step_timeout_s)" in (hung.error or ""), hung.error


def _info_env(info: Any) -> type:
    class BadInfo(_Env):
        def __init__(self) -> None:
            self.task: dict[str, Any] = {}

        def reset(self, task: dict[str, Any]) -> Any:
            self.task = task
            return ""

        def step(self, action: str) -> StepResult:
            # only the second episode's environment misbehaves
            return StepResult(done=True, info=info if self.task.get("i") == 1 else {"tool_calls": 1})

    return BadInfo


@pytest.mark.parametrize(
    ("info", "said"),
    [
        ({"calls": 7}, "StepResult.info['calls'] is 7, not a list of dicts"),
        ({"tool_calls": "many"}, "StepResult.info['tool_calls'] is 'many', not a count"),
        ({"tool_errors": True}, "StepResult.info['tool_errors'] is True, not a count"),
        ({"tool_latencies_s": "x"}, "StepResult.info['tool_latencies_s'] is 'x', not a list of finite numbers"),
        (["solved"], "StepResult.info is list, not a dict"),
    ],
    ids=["calls-int", "tool-calls-str", "tool-errors-bool", "latencies-str", "info-list"],
)
def test_an_environment_info_the_run_cannot_read_ends_only_its_episode(
    rollout: Rollout, tok: Any, info: Any, said: str
) -> None:
    """Issue 35, round 12: ``info["calls"] = 7`` from one episode's environment raised
    TypeError out of the step that gathers every episode's counts: the run died (exit 1,
    'failed at step 3'). It ends that episode, naming the field, and the batch goes on."""
    episodes, _ = run_episodes(rollout, tok, _info_env(info), LIMITS)
    assert [ep.finish for ep in episodes] == ["done", "error"]
    assert said in (episodes[1].error or ""), episodes[1].error
    batch = episode_batch(episodes, tok.pad_token_id)
    metrics = episode_metrics([ep.record() for ep in episodes])
    assert len(batch) == 2 and metrics["agent/tool_calls"] == 1.0


def _done_env(done: Any) -> type:
    class BadDone(_Env):
        def __init__(self) -> None:
            self.task: dict[str, Any] = {}

        def reset(self, task: dict[str, Any]) -> Any:
            self.task = task
            return ""

        def step(self, action: str) -> StepResult:
            return StepResult(done=done if self.task.get("i") == 1 else True)

    return BadDone


@pytest.mark.parametrize(
    ("done", "said"),
    [("False", "StepResult.done is 'False', not a bool"), (np.array([True, False]), "StepResult.done is array(")],
    ids=["a-string", "an-array"],
)
def test_a_done_that_is_no_bool_ends_its_episode_naming_the_field(
    rollout: Rollout, tok: Any, done: Any, said: str
) -> None:
    """Issue 35, round 14: ``done="False"`` (as a JSON environment server sends it) is true, so
    every episode silently ended after one turn; an array raised inside the runner, blamed on
    the environment's step. Either ends that episode, naming the field."""
    episodes, _ = run_episodes(rollout, tok, _done_env(done), LIMITS)
    assert [ep.finish for ep in episodes] == ["done", "error"]
    assert said in (episodes[1].error or ""), episodes[1].error


def test_numpys_bool_is_a_done() -> None:
    from geartrain.agents.runner import _step_result_problem

    assert _step_result_problem(StepResult(done=np.bool_(True))) is None
