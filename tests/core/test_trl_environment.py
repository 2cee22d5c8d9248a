"""TRL ``environment_factory`` classes as geartrain environments
(:mod:`geartrain.agents.trl_environment`): found by ``load_environment``, their methods as
tools with TRL's specs, ``reset`` with the row's columns and its text appended to the last
user message, ``get_reward`` on the episode's last turn. The model's turns come from a
scripted ``generate`` (the core's plumbing under test, not a rollout)."""

from __future__ import annotations

import json
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from geartrain import SamplingParams
from geartrain.agents import AgentConfig, EpisodeRunner, RunnerLimits, episode_metrics, load_environment
from geartrain.agents.trl_environment import TRLEnvironment
from geartrain.data import PromptBatch, PromptDataset
from geartrain.data.config import DataConfig
from geartrain.errors import GeartrainError
from geartrain.rewards import get_reward
from geartrain.testing.tiny import tiny_tokenizer
from geartrain.trainer.config import TrainConfig
from geartrain.trainer.episodes import annotate_episodes, episode_prompt_batch, run_episode_share
from scripted_turns import scripted_generate
from transformers.utils import get_json_schema

# a TRL environment as TRL's docs write them: tools are the public methods (Google-style
# docstrings), reset(**row) may return text for the prompt, get_reward scores the rollout
COUNTER = '''
import json
import time
from pathlib import Path

RESETS = Path(__file__).with_name("resets.jsonl")


class Counter:
    def reset(self, **kwargs):
        with RESETS.open("a") as f:
            f.write(json.dumps(kwargs) + "\\n")
        self.target = int(kwargs["answer"])
        self.count = 0
        return f" Reach {self.target}."

    def increment(self, step: int) -> str:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        time.sleep(0.05 * step)  # run at once, a later smaller step would finish first
        self.count += step
        return str(self.count)

    async def peek(self) -> str:
        """Read the counter."""
        return f"at {self.count}"

    def _helper(self):
        return None

    def get_reward(self) -> float:
        if self.target < 0:
            raise RuntimeError("no score for a negative target")
        return 1.0 if self.count == self.target else 0.25
'''


def _call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture
def counter(tmp_path: Path) -> tuple[Path, Any]:
    (tmp_path / "counter_env.py").write_text(textwrap.dedent(COUNTER))
    factory = load_environment("counter_env.py:Counter", base_dir=str(tmp_path))
    env = factory()
    return tmp_path, env


def _dataset(tok: Any, answer: int, tools: list[dict[str, Any]]) -> PromptBatch:
    rows = [{"prompt": [{"role": "user", "content": "Count up."}], "answer": answer, "level": 2}]
    data = PromptDataset(rows, tok, DataConfig(ground_truth_key="answer"), tools=tools)
    return PromptBatch(rows=list(data.rows), indices=[0], epoch=0)


def _counter_episode(
    counter: tuple[Path, Any],
    tok: Any,
    turns: list[str],
    *,
    answer: int = 5,
    max_turns: int,
    max_tokens: int,
    chat: bool = True,
) -> tuple[EpisodeRunner, Any]:
    """One episode of the ``counter`` fixture's environment on the task ``answer``, the
    model's turns scripted; the runner and the episode."""
    tmp_path, env = counter
    prompts = _dataset(tok, answer, env.tools)
    runner = EpisodeRunner(
        scripted_generate(tok, turns),
        tok,
        load_environment("counter_env.py:Counter", base_dir=str(tmp_path)),
        RunnerLimits(max_turns=max_turns, max_model_len=512),
        chat_template=chat,
    )
    task = episode_prompt_batch(prompts, "answer").meta["task"][0]
    (ep,), _ = runner.run(prompts.prompt_ids, [task], SamplingParams(n=1, max_tokens=max_tokens))
    return runner, ep


def test_a_trl_environment_class_is_wrapped_with_its_methods_as_tools(counter: tuple[Path, Any]) -> None:
    _, env = counter
    assert isinstance(env, TRLEnvironment)
    assert list(env.registry) == ["increment", "peek"]  # not reset, get_reward or _helper
    assert env.tools == [get_json_schema(env.instance.increment), get_json_schema(env.instance.peek)]
    assert env.stop_texts == ["</tool_call>"]


def test_an_episode_runs_as_trl_runs_it(counter: tuple[Path, Any]) -> None:
    """reset gets the row's columns (the conversation as ``prompt``, the answer under its
    column); its text joins the last user message; the calls run on the episode's
    instance (the async one too); a turn without a call ends the episode; get_reward is
    added to the last turn."""
    tmp_path, env = counter
    tok = tiny_tokenizer()
    prompts = _dataset(tok, 5, env.tools)
    turns = [_call("increment", step=3), _call("increment", step=2), _call("peek"), "done"]
    agent = AgentConfig(environment="counter_env.py:Counter", chat_template=True, max_turns=4)
    batch, _ = run_episode_share(
        scripted_generate(tok, turns),
        tok,
        episode_prompt_batch(prompts, "answer"),
        SamplingParams(n=1, max_tokens=64),
        agent,
        base_dir=str(tmp_path),
        max_model_len=512,
    )
    reset = json.loads((tmp_path / "resets.jsonl").read_text().splitlines()[-1])
    # the answer as the row holds it (the int 5), as TRL passes it: a string made a
    # comparison such as kwargs["answer"] == self.count always false
    assert reset == {"prompt": [{"role": "user", "content": "Count up."}], "answer": 5, "level": 2}
    # TRL's prompt: the reset text appended to the last user message, then the template
    trl_prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Count up. Reach 5."}], add_generation_prompt=True, tokenize=False
    )
    width = batch.info["prompt_length"]
    prompt_ids = batch["input_ids"][0, :width][batch["attention_mask"][0, :width].bool()].tolist()
    assert tok.decode(prompt_ids) == trl_prompt
    assert prompt_ids == tok.encode(trl_prompt, add_special_tokens=False)
    (record,) = batch["episode"]
    observations = [t["text"] for t in record["turns"] if t["role"] == "observation"]
    assert observations == ["3", "5", "at 5"]  # the tools ran on one instance; the async one too
    assert [c["name"] for c in record["calls"]] == ["increment", "increment", "peek"]
    assert record["finish"] == "done"
    assert record["rewards"] == [0.0, 0.0, 0.0, 1.0]  # count == target: get_reward 1.0, on the last turn
    assert float(batch["turn_rewards"].sum()) == 1.0
    # reward functions see the prompt as the model saw it, as TRL's do
    batch, _ = annotate_episodes(batch, prompts, 1)
    assert batch["prompt"] == [trl_prompt]
    assert batch["prompt_messages"] == [[{"role": "user", "content": "Count up. Reach 5."}]]


def test_get_reward_scores_an_episode_cut_by_max_turns_and_its_failure_is_the_episodes(
    counter: tuple[Path, Any],
) -> None:
    tok = tiny_tokenizer()

    def run(answer: int) -> Any:
        _, ep = _counter_episode(counter, tok, [_call("increment", step=3)], answer=answer, max_turns=1, max_tokens=64)
        return ep

    ep = run(5)
    assert ep.finish == "max_turns" and ep.error is None
    assert ep.segments[-1].kind == "model" and ep.segments[-1].reward == 0.25  # scored although not done
    ep = run(-1)
    assert ep.finish == "error" and "no score for a negative target" in (ep.error or "")


def test_a_class_with_neither_step_nor_reset_is_refused_by_name() -> None:
    class Nothing:
        def act(self) -> None:
            return None

    with pytest.raises(GeartrainError, match="Nothing has no reset or step method.*TRL environment_factory"):
        load_environment(Nothing)


def test_the_environment_reward_adds_nothing_and_reports_the_environments_rewards() -> None:
    """``reward.function = "environment"`` (TRL's reward_funcs left out): score 0, since the
    environment's rewards are already on the turns, their sum as ``env_reward`` and
    ``acc`` = rewarded; refused on a job without episodes."""
    reward = get_reward("environment")
    rewarded = reward("done", "", meta={"episode": {"rewards": [0.0, 0.25, 1.0]}})
    assert rewarded == {"score": 0.0, "acc": 1.0, "env_reward": 1.25}
    assert reward("done", "", meta={"episode": {"rewards": [0.0]}})["acc"] == 0.0
    records = [{"rewards": [0.0, 1.0]}, {"rewards": [0.5]}]
    assert episode_metrics([{**_RECORD, **r} for r in records])["agent/env_reward_mean"] == 0.75
    with pytest.raises(ValueError, match="'environment' reward scores multi-turn episodes"):
        TrainConfig.model_validate({"reward": {"function": "environment"}})
    TrainConfig.model_validate({"reward": {"function": "environment"}, "rollout": {"agent": {"environment": "tools"}}})


_RECORD = {
    "tool_calls": 0,
    "tool_errors": 0,
    "tool_latencies_s": [],
    "model_turns": 1,
    "truncated": False,
    "finish": "done",
    "model_tokens": 1,
    "observation_tokens": 0,
}


TOOLS = '''
async def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def shout(text):
    return text.upper()
'''


def test_trl_style_tools_in_a_file_next_to_the_job(tmp_path: Path) -> None:
    """TRL's ``GRPOTrainer(tools=[multiply])``: the built-in ``tools`` environment takes
    ``my_tools.py:fn`` next to the job file; a Google-style docstring gives TRL's spec
    (``get_json_schema``), an undocumented function the signature's; async tools run."""
    (tmp_path / "my_tools.py").write_text(TOOLS)
    factory = load_environment(
        "tools",
        kwargs={"tools": ["my_tools.py:multiply", "my_tools.py:shout"], "call_format": "hermes"},
        base_dir=str(tmp_path),
    )
    env = factory()
    multiply_spec, shout_spec = env.tools
    assert multiply_spec == get_json_schema(env.registry["multiply"].fn)
    assert multiply_spec["function"]["parameters"]["properties"]["a"]["description"] == "The first factor."
    assert shout_spec["function"]["parameters"] == {"type": "object", "properties": {"text": {}}, "required": ["text"]}
    result = env.step(_call("multiply", a=6, b=7))
    assert result.observation == "<tool_response>\n42\n</tool_response>\n" and result.info["tool_errors"] == 0
    with pytest.raises(GeartrainError, match=r"rollout.agent.environment_kwargs.tools = 'nope.py:f'"):
        load_environment("tools", kwargs={"tools": ["nope.py:f"]}, base_dir=str(tmp_path))


def test_under_a_chat_template_a_hermes_turn_ends_at_eos_and_may_make_several_calls(
    counter: tuple[Path, Any],
) -> None:
    """As TRL and verl generate a tool-calling turn: to the template's end of turn (EOS),
    every call in it run; as plain text a hermes turn still ends at its first call."""
    tok = tiny_tokenizer()
    two_calls = _call("increment", step=3) + _call("increment", step=2) + tok.eos_token

    def run(chat: bool) -> Any:
        return _counter_episode(
            counter, tok, [two_calls, "done" + tok.eos_token], max_turns=3, max_tokens=128, chat=chat
        )

    runner, ep = run(chat=True)
    assert runner.stop_texts == []  # EOS (the rollout's stop token) ends the turn
    first = ep.segments[0]
    assert first.kind == "model" and tok.decode(first.ids) == two_calls
    assert ep.record()["calls"] == [
        {"name": "increment", "ok": True, "result": "3"},
        {"name": "increment", "ok": True, "result": "5"},
    ]
    assert ep.segments[-1].reward == 1.0  # both calls counted: 3 + 2 == 5
    runner, ep = run(chat=False)
    assert runner.stop_texts == ["</tool_call>"]
    assert tok.decode(ep.segments[0].ids) == _call("increment", step=3)  # cut at its first call


def test_get_reward_runs_on_the_episodes_worker_thread_not_the_scheduler() -> None:
    """An episode that ends with a step (done, or its last allowed turn) is scored on the
    worker thread that ran the step, and one cut by its token budget on a worker thread too,
    so a slow get_reward (a judge model) holds up only its own episode, not the generation
    of the others."""
    threads: list[str] = []

    class Judge:
        def reset(self, **kwargs: Any) -> None:
            return None

        def get_reward(self) -> float:
            threads.append(threading.current_thread().name)
            return 0.5

    tok = tiny_tokenizer()
    prompt = tok.encode("q", add_special_tokens=False)
    for script, max_turns in ((["done"], 2), ([_call("nothing")], 1)):  # done; cut by max_turns
        runner = EpisodeRunner(
            scripted_generate(tok, list(script)),
            tok,
            load_environment(Judge),
            RunnerLimits(max_turns=max_turns, max_model_len=512),
        )
        (ep,), _ = runner.run([prompt], [{}], SamplingParams(n=1, max_tokens=64))
        assert ep.error is None and ep.segments[0].reward == 0.5, ep

    def fills_the_budget(prompts: list[list[int]], params: SamplingParams) -> Any:
        out = scripted_generate(tok, ["x" * params.max_tokens])(prompts, params)
        out["finish_reason"] = ["length"]
        return out

    runner = EpisodeRunner(fills_the_budget, tok, load_environment(Judge), RunnerLimits(max_turns=3, max_model_len=9))
    (ep,), _ = runner.run([prompt], [{}], SamplingParams(n=1, max_tokens=64))  # cut by its token budget
    assert ep.finish == "truncated" and ep.error is None and ep.segments[0].reward == 0.5, ep
    assert len(threads) == 3 and all(name.startswith("geartrain-env") for name in threads), threads


class _Typed:
    """A TRL environment whose get_reward returns numbers TRL takes as rewards (it builds
    torch.tensor(rewards, dtype=float32)): a bool, numpy scalars."""

    value: Any = None

    def reset(self, **kwargs: Any) -> None:
        return None

    def get_reward(self) -> Any:
        return _Typed.value


@pytest.mark.parametrize(("value", "expected"), [(True, 1.0), (np.float32(0.5), 0.5), (np.int64(2), 2.0)])
def test_get_reward_may_return_any_real_number_as_in_trl(value: Any, expected: float) -> None:
    """``return self.solved`` or a numpy score scores the episode, as in TRL; it ended the
    episode as an error ("not a finite number")."""
    tok = tiny_tokenizer()
    _Typed.value = value
    runner = EpisodeRunner(
        scripted_generate(tok, ["done"]), tok, load_environment(_Typed), RunnerLimits(max_turns=2, max_model_len=512)
    )
    (ep,), _ = runner.run([tok.encode("Hi.", add_special_tokens=False)], [{}], SamplingParams(n=1, max_tokens=16))
    assert ep.error is None and ep.finish == "done"
    assert ep.segments[-1].reward == expected and type(ep.segments[-1].reward) is float


class _Walker:
    """A TRL game environment whose move tool is named ``step``: TRL calls ``reset(**row)``,
    so a ``reset`` that takes no positional argument cannot be a geartrain environment's."""

    def reset(self, **kwargs: Any) -> str:
        self.position = 0
        return " Walk to 3."

    def step(self, steps: int) -> str:
        """Walk forward.

        Args:
            steps: How far.
        """
        self.position += steps
        return str(self.position)

    def get_reward(self) -> float:
        return float(self.position == 3)


def test_a_trl_environment_with_a_tool_named_step_is_still_a_trl_environment() -> None:
    """It was taken for a geartrain environment (it has a ``step``): every episode ended as
    an error (``reset() takes 1 positional argument``)."""
    env = load_environment(_Walker)()
    assert isinstance(env, TRLEnvironment) and list(env.registry) == ["step"]
    tok = tiny_tokenizer()
    runner = EpisodeRunner(
        scripted_generate(tok, [_call("step", steps=3), "done"]),
        tok,
        load_environment(_Walker),
        RunnerLimits(max_turns=3, max_model_len=512),
    )
    (ep,), _ = runner.run([tok.encode("Go.", add_special_tokens=False)], [{}], SamplingParams(n=1, max_tokens=64))
    assert ep.error is None and ep.finish == "done"
    assert ep.record()["calls"] == [{"name": "step", "ok": True, "result": "3"}]
    assert ep.segments[-1].reward == 1.0

    class Plain:  # a geartrain environment (no base class) whose reset is a staticmethod
        @staticmethod
        def reset(task: Any) -> str:
            return ""

        def step(self, action: str) -> Any:
            return None

    assert not isinstance(load_environment(Plain)(), TRLEnvironment)


def test_a_trl_turn_runs_every_call_it_makes_as_trl_does(counter: tuple[Path, Any]) -> None:
    """TRL runs every call of a turn (no per-turn limit); the tool environment's default
    limit of 4 turned the fifth into an error."""
    tok = tiny_tokenizer()
    turns = [_call("increment", step=1) * 5 + tok.eos_token, "done" + tok.eos_token]
    _, ep = _counter_episode(counter, tok, turns, max_turns=3, max_tokens=256)
    assert [c["result"] for c in ep.record()["calls"]] == ["1", "2", "3", "4", "5"]
    assert ep.segments[-1].reward == 1.0


def test_reset_text_joins_the_prompt_as_trl_tokenizes_it() -> None:
    """TRL tokenizes its re-rendered prompt whole, so where the user message and reset's
    text meet, tokens may merge: "say a" + "! go" is "say " "a!" " go" under a tokenizer
    that merges "a" "!", not "a" "!" as the two encoded apart would give."""
    from test_stop_texts import merging_tokenizer

    class Greeter:
        def reset(self, **kwargs: Any) -> str:
            return "! go"

    tok = merging_tokenizer()
    prompt = "say a"
    runner = EpisodeRunner(
        scripted_generate(tok, ["done"]), tok, load_environment(Greeter), RunnerLimits(max_turns=1, max_model_len=64)
    )
    ids = tok.encode(prompt, add_special_tokens=False)
    (ep,), _ = runner.run([ids], [{"prompt": prompt}], SamplingParams(n=1, max_tokens=8))
    assert ep.prompt_ids == tok.encode("say a! go", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ep.prompt_ids)[4] == "a!"
    assert ep.prompt_text == "say a! go" and ep.prompt_extension == "! go"


class _Tally:
    """A TRL environment that counts its constructions and scores the row's answer against
    what its tool was told: a reused instance must start each episode afresh."""

    built = 0
    release = threading.Event()
    hung: Any = None

    def __init__(self, offset: int = 0) -> None:
        _Tally.built += 1
        self.offset = offset

    def reset(self, **kwargs: Any) -> None:
        self.target, self.said = int(kwargs["answer"]), None

    def say(self, value: int) -> str:
        """Say a number.

        Args:
            value: The number.
        """
        if value < 0:
            _Tally.hung = self
            _Tally.release.wait()  # a tool that hangs until the test lets it go (its thread is a daemon)
        self.said = value + self.offset
        return "ok"

    def get_reward(self) -> float:
        return float(self.said == self.target)


def _saying(tok: Any, values: list[int]) -> Any:
    """A ``generate`` whose episode ``i`` (by prompt text ``"<i>"``) calls ``say(values[i])``,
    then ends."""
    from geartrain.layout import sequence_batch

    def generate(prompts: list[list[int]], params: SamplingParams) -> Any:
        turns = []
        for ids in prompts:
            text = tok.decode(ids)
            said = "</tool_call>" in text
            turns.append("done" if said else _call("say", value=values[int(text.split(">")[0].strip("<"))]))
        out = sequence_batch(prompts, [tok.encode(t, add_special_tokens=False) for t in turns], tok.pad_token_id)
        out["rollout_log_probs"] = torch.zeros(out["input_ids"].shape)
        out["finish_reason"] = ["stop"] * len(prompts)
        return out

    return generate


def test_instances_are_built_once_and_reset_for_each_episode_as_trl_pools_them() -> None:
    """TRL builds an environment once per concurrent rollout and resets it for the next
    ("construct once, reset often"); a fresh instance per episode rebuilt an expensive
    environment (a sandbox, a loaded dataset) for every episode of every step."""
    tok = tiny_tokenizer()
    _Tally.built = 0
    factory = load_environment(_Tally, kwargs={"offset": 1})
    answers = [3, 5, 7, 9, 11, 13]

    def step(values: list[int]) -> list[Any]:
        runner = EpisodeRunner(_saying(tok, values), tok, factory, RunnerLimits(max_turns=3, max_model_len=512))
        prompts = [tok.encode(f"<{i}>", add_special_tokens=False) for i in range(len(answers))]
        episodes, _ = runner.run(prompts, [{"answer": a} for a in answers], SamplingParams(n=1, max_tokens=64))
        return episodes

    # every episode is scored on its own row, whichever instance ran it before (offset 1)
    first = step([a - 1 for a in answers])
    assert [ep.segments[-1].reward for ep in first] == [1.0] * 6, [ep.error for ep in first]
    built = _Tally.built
    assert 1 <= built <= len(answers) + 1  # the runner's probe seeds the pool
    second = step([a - 1 if i % 2 else a for i, a in enumerate(answers)])
    assert [ep.segments[-1].reward for ep in second] == [0.0, 1.0] * 3
    assert _Tally.built == built  # the second step reused them all


def test_an_instance_still_busy_when_its_episode_ends_is_never_reused() -> None:
    """A tool call that outran ``step_timeout_s`` goes on running on its thread: its
    instance must not serve another episode (two episodes would share its state)."""
    tok = tiny_tokenizer()
    _Tally.release.clear()
    factory = load_environment(_Tally)
    runner = EpisodeRunner(
        _saying(tok, [-1]), tok, factory, RunnerLimits(max_turns=3, max_model_len=512), step_timeout_s=0.3
    )
    (hung,), _ = runner.run([tok.encode("<0>", add_special_tokens=False)], [{"answer": 1}], SamplingParams(n=1))
    try:
        assert hung.finish == "error" and "step_timeout_s" in (hung.error or ""), hung.error
        drawn = [factory() for _ in range(3)]  # more than the pool ever held (the probe's, the hung one)
        assert _Tally.hung is not None and all(env.instance is not _Tally.hung for env in drawn)
    finally:
        _Tally.release.set()


def test_an_episode_given_back_twice_is_pooled_once() -> None:
    factory = load_environment(_Tally)
    env = factory()
    env.close()
    env.close()
    assert factory() is env and factory() is not env


def test_a_row_without_a_prompt_is_the_environments_to_fill_as_in_trl(counter: tuple[Path, Any]) -> None:
    """TRL's rule for environments that own the task: a row without ``prompt`` is an empty
    user message, and reset's text fills it (the prompt the model sees is reset's text as
    the user's turn). Such a row was refused ("needs exactly one of 'prompt' and 'messages'")."""
    tmp_path, env = counter
    tok = tiny_tokenizer()
    rows = [{"answer": 5}]
    with pytest.raises(Exception, match="exactly one of 'prompt' and 'messages'"):
        PromptDataset(rows, tok, DataConfig(ground_truth_key="answer"))
    data = PromptDataset(rows, tok, DataConfig(ground_truth_key="answer"), prompt_optional=True)
    prompts = PromptBatch(rows=list(data.rows), indices=[0], epoch=0)
    runner = EpisodeRunner(
        scripted_generate(tok, ["done"]),
        tok,
        load_environment("counter_env.py:Counter", base_dir=str(tmp_path)),
        RunnerLimits(max_turns=2, max_model_len=512),
        chat_template=True,
    )
    task = episode_prompt_batch(prompts, "answer").meta["task"][0]
    (ep,), _ = runner.run(prompts.prompt_ids, [task], SamplingParams(n=1, max_tokens=16))
    trl_prompt = tok.apply_chat_template(
        [{"role": "user", "content": " Reach 5."}], add_generation_prompt=True, tokenize=False
    )
    assert ep.error is None and ep.prompt_ids == tok.encode(trl_prompt, add_special_tokens=False)
    with pytest.raises(Exception, match="needs data.apply_chat_template"):
        PromptDataset(rows, tok, DataConfig(ground_truth_key="answer", apply_chat_template=False), prompt_optional=True)
    # a multi-turn job's data checks take such rows; a job without an environment does not
    from geartrain.errors import ConfigError
    from geartrain.trainer.preflight import preflight

    job = {
        "model": {"tiny": "qwen2"},
        "reward": {"function": "environment"},
        "data": {"answer_key": "answer", "batch_size": 1},
        "rollout": {"agent": {"environment": "counter_env.py:Counter", "chat_template": True}},
        "base_dir": str(tmp_path),
    }
    pre = preflight(TrainConfig.model_validate(job), tokenizer=tok, data=rows)
    assert [r.prompt for r in pre.datasets["data.path"].rows] == [
        tok.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=False)
    ]
    plain = {**job, "reward": {"function": "arithmetic"}, "rollout": {}}
    with pytest.raises(ConfigError, match="exactly one of 'prompt' and 'messages'"):
        preflight(TrainConfig.model_validate(plain), tokenizer=tok, data=rows)
