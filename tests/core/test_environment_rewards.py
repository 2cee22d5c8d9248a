"""TRL's ``environments`` argument of reward functions: each sample's environment as its
episode left it (:mod:`geartrain.agents.env_state`), so TRL's examples'
``[env.reward for env in environments]`` score geartrain episodes. The model's turns come
from a scripted ``generate`` (the core's plumbing under test)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from geartrain import SamplingParams
from geartrain.agents import EpisodeRunner, RunnerLimits, load_environment
from geartrain.agents.env_state import MAX_ITEMS, EnvironmentState, capture_state
from geartrain.data import PromptBatch, PromptDataset
from geartrain.data.config import DataConfig
from geartrain.layout import sequence_batch
from geartrain.rewards import score_batch
from geartrain.rewards.terms import make_term
from geartrain.testing.tiny import tiny_tokenizer
from geartrain.trainer.episodes import annotate_episodes, episode_batch, episode_prompt_batch


class Client:
    """Stands for what a TRL environment holds that is not data (an OpenEnv client)."""


class Game:
    """A TRL environment as TRL's OpenEnv examples write them: the tool sets ``reward`` and
    ``done``, and the reward function reads them (no get_reward)."""

    def __init__(self) -> None:
        self.client = Client()

    def reset(self, **kwargs: Any) -> None:
        self.target, self.reward, self.done = int(kwargs["answer"]), 0.0, False
        self.history: list[int] = []

    def guess(self, value: int) -> str:
        """Guess the number.

        Args:
            value: The guess.
        """
        self.history.append(value)
        self.reward, self.done = (1.0, True) if value == self.target else (np.float32(0.25), False)
        return "yes" if self.done else "no"

    def score(self) -> float:
        return self.reward


def _call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _episodes(guesses: list[int], answers: list[int]) -> tuple[Any, Any]:
    """Episode ``i`` guesses ``guesses[i]`` once; one pooled instance serves them one after
    another (a step each), so each one's state must be taken before the next reset."""
    tok = tiny_tokenizer()
    rows = [{"prompt": f"<{i}>", "answer": a} for i, a in enumerate(answers)]
    data = PromptDataset(rows, tok, DataConfig(ground_truth_key="answer", apply_chat_template=False))
    prompts = PromptBatch(rows=list(data.rows), indices=list(range(len(rows))), epoch=0)

    def generate(batch_prompts: list[list[int]], params: SamplingParams) -> Any:
        texts = [tok.decode(p) for p in batch_prompts]
        said = ["done" if "<tool_call>" in t else _call("guess", value=guesses[int(t[1])]) for t in texts]
        out = sequence_batch(batch_prompts, [tok.encode(t, add_special_tokens=False) for t in said], tok.pad_token_id)
        out["rollout_log_probs"] = torch.zeros(out["input_ids"].shape)
        out["finish_reason"] = ["stop"] * len(batch_prompts)
        return out

    factory = load_environment(Game)
    runner = EpisodeRunner(generate, tok, factory, RunnerLimits(max_turns=2, max_model_len=256))
    tasks = episode_prompt_batch(prompts, "answer").meta["task"]
    episodes = []
    for ids, task in zip(prompts.prompt_ids, tasks, strict=True):
        (ep,), _ = runner.run([ids], [task], SamplingParams(n=1, max_tokens=64))
        episodes.append(ep)
    assert factory.built == 1  # one instance ran them all
    batch, _ = annotate_episodes(episode_batch(episodes, tok.pad_token_id), prompts, 1)
    return batch, episodes


def test_a_trl_reward_function_reads_each_samples_environment_as_its_episode_left_it() -> None:
    def env_reward(environments: list[Any], **kwargs: Any) -> list[float]:
        return [env.reward for env in environments]

    def history_length(completions: list[Any], environments: list[Any]) -> list[float]:
        return [float(len(env.history)) + (10.0 if env.done else 0.0) for env in environments]

    batch, _ = _episodes(guesses=[3, 5, 7], answers=[3, 4, 7])
    for fn, expected in ((env_reward, [1.0, 0.25, 1.0]), (history_length, [11.0, 1.0, 11.0])):
        term = make_term(fn)
        assert term.batched  # TRL's convention: called with keywords, a list per batch
        result = score_batch(term.fn, batch["response_text"], batch["ground_truth"], metas=batch["data_meta"])
        assert result.errors == [] and result.scores.tolist() == expected, fn.__name__


def test_what_does_not_reach_reward_functions_says_why() -> None:
    batch, _ = _episodes(guesses=[2], answers=[2])
    (state,) = [EnvironmentState(m["episode"]["environment_state"]) for m in batch["data_meta"]]
    assert state.reward == 1.0 and state.target == 2 and state.history == [2]
    with pytest.raises(AttributeError, match=r"Game.client \(a Client\) does not reach reward functions.*get_reward"):
        _ = state.client
    with pytest.raises(AttributeError, match="Game had no attribute 'score'.*methods run on the rollout ranks"):
        state.score()
    with pytest.raises(AttributeError, match="read-only"):
        state.reward = 0.0

    class Big:
        def __init__(self) -> None:
            self.table = list(range(MAX_ITEMS + 1))
            self.level = np.int64(3)
            self.score = torch.tensor(0.5)  # a torch scalar, as rewards often are
            self.nested = {"a": [1, {"b": "c"}]}

    captured = capture_state(Big())
    assert captured["score"] == 0.5 and type(captured["score"]) is float
    assert captured["level"] == 3 and type(captured["level"]) is int and captured["nested"] == {"a": [1, {"b": "c"}]}
    assert "table" not in captured
    with pytest.raises(AttributeError, match=rf"Big.table \(a list of {MAX_ITEMS + 1} items"):
        _ = EnvironmentState(captured).table


def test_a_reward_taking_environments_on_a_job_without_episodes_says_so(caplog: pytest.LogCaptureFixture) -> None:
    def env_reward(environments: list[Any], **kwargs: Any) -> list[float]:
        return [0.0 for _ in environments]

    result = score_batch(make_term(env_reward).fn, ["x"], ["1"], metas=[{}])
    assert result.errors == [0]
    assert "only multi-turn episodes have: set rollout.agent.environment" in caplog.text, caplog.text


def test_a_job_without_episodes_is_refused_a_reward_taking_environments(tmp_path: Any) -> None:
    from geartrain.errors import ConfigError
    from geartrain.trainer.config import TrainConfig
    from geartrain.trainer.preflight import preflight

    (tmp_path / "env_rewards.py").write_text("def from_env(environments, **kwargs):\n    return [1.0]\n")
    config = TrainConfig.model_validate(
        {
            "model": {"tiny": "qwen2"},
            "reward": {"function": "env_rewards.py:from_env"},
            "data": {"apply_chat_template": False},
            "base_dir": str(tmp_path),
        }
    )
    with pytest.raises(ConfigError, match="takes 'environments'.*set rollout.agent.environment"):
        preflight(config, tokenizer=tiny_tokenizer(), data=[{"prompt": "1+1=", "ground_truth": "2"}])


def test_trls_run_time_keywords_reach_a_batched_reward() -> None:
    """``trainer_state``, ``completion_ids``, ``log_metric`` and ``log_extra`` as TRL passes
    them; what is logged survives the trip of a result across reward workers (rows)."""
    from geartrain.layout import sequence_batch
    from geartrain.rewards import RewardResult, RewardScorer
    from geartrain.rewards.terms import TrainerState
    from geartrain.trainer.roles import completion_ids

    def shaped(completions: list[str], trainer_state: Any, completion_ids: list[list[int]], **kwargs: Any) -> list:
        kwargs["log_metric"]("ids", float(sum(map(len, completion_ids))))
        kwargs["log_metric"]("ids", 1.0)
        kwargs["log_extra"]("first", [ids[0] for ids in completion_ids])
        return [trainer_state.global_step / trainer_state.max_steps + len(ids) for ids in completion_ids]

    batch = sequence_batch([[5, 6], [7]], [[8, 9, 10], [11]], 0)
    ids = completion_ids(batch)
    assert ids == [[8, 9, 10], [11]]  # the response tokens, not the padding
    result = RewardScorer(shaped).score(
        ["a", "b"], ["", ""], trainer_state=TrainerState(global_step=2, max_steps=4, epoch=0.0), completion_ids=ids
    )
    assert result.errors == [] and result.scores.tolist() == [3.5, 1.5]
    assert result.metrics["reward/ids"] == 2.5  # the mean of what was logged for the batch
    again = RewardResult.from_rows(result.rows())
    assert again.columns == {"first": [8, 11]} and again.metrics["reward/ids"] == 2.5

    def too_short(completions: list[str], log_extra: Any) -> list[float]:
        log_extra("x", [1])
        return [0.0, 0.0]

    assert RewardScorer(too_short).score(["a", "b"], ["", ""]).errors == [0, 1]


def test_the_start_up_check_gives_a_reward_the_runs_max_steps(tmp_path: Any) -> None:
    """A reward shaped by progress (``global_step / max_steps``) divided by zero in the
    check before the run, which then refused the job."""
    from geartrain.trainer.config import TrainConfig
    from geartrain.trainer.preflight import preflight

    (tmp_path / "shaped.py").write_text(
        "def by_progress(completions, trainer_state, **kwargs):\n"
        "    return [trainer_state.global_step / trainer_state.max_steps for _ in completions]\n"
    )
    config = TrainConfig.model_validate(
        {
            "model": {"tiny": "qwen2"},
            "reward": {"function": "shaped.py:by_progress"},
            "data": {"apply_chat_template": False, "batch_size": 1},
            "trainer": {"total_steps": 7},
            "base_dir": str(tmp_path),
        }
    )
    preflight(config, tokenizer=tiny_tokenizer(), data=[{"prompt": "1+1=", "ground_truth": "2"}])
