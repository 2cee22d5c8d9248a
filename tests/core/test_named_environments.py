"""Named environments (TRL's dict ``environment_factory``): ``rollout.agent.environment``
as a table ``{name = spec}``, each data row naming its own in ``environment_key``. Each
row's prompt shows its environment's tools, each episode runs in its environment with its
``environment_kwargs``, and ``reset`` does not get the naming column. The model's turns
come from a scripted ``generate`` (the core's plumbing under test)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from geartrain import SamplingParams
from geartrain.agents import AgentConfig, EnvironmentRouter, EpisodeRunner, RunnerLimits, load_environments
from geartrain.data import PromptBatch
from geartrain.errors import ConfigError
from geartrain.layout import sequence_batch
from geartrain.testing.tiny import tiny_tokenizer
from geartrain.trainer.config import TrainConfig
from geartrain.trainer.episodes import episode_prompt_batch
from geartrain.trainer.preflight import preflight
from test_environment_contract import TOOLS_TEMPLATE

ENVS = '''
class Doubler:
    """Rewards the row's answer doubled, said through its tool."""

    def __init__(self, factor=2):
        self.factor = factor

    def reset(self, **kwargs):
        assert "environment" not in kwargs, kwargs  # TRL's control field is not passed on
        self.target, self.said = int(kwargs["answer"]) * self.factor, None
        return " Double it."

    def double(self, value: int) -> str:
        """Say the answer doubled.

        Args:
            value: The doubled answer.
        """
        self.said = value
        return "ok"

    def get_reward(self) -> float:
        return float(self.said == self.target)


class Echo:
    def reset(self, **kwargs):
        assert "environment" not in kwargs, kwargs
        self.target, self.said = int(kwargs["answer"]), None

    def echo(self, value: int) -> str:
        """Say the answer.

        Args:
            value: The answer.
        """
        self.said = value
        return "ok"

    def get_reward(self) -> float:
        return float(self.said == self.target)
'''

ROWS = [
    {"prompt": [{"role": "user", "content": f"q{i}"}], "answer": i, "environment": "echo" if i % 2 else "triple"}
    for i in range(4)
]


def _call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _config(tmp_path: Path, **agent: Any) -> TrainConfig:
    (tmp_path / "named_envs.py").write_text(textwrap.dedent(ENVS))
    return TrainConfig.model_validate(
        {
            "model": {"tiny": "qwen2"},
            "reward": {"function": "environment"},
            "data": {"answer_key": "answer", "max_prompt_length": 200, "batch_size": len(ROWS)},
            "rollout": {
                "max_model_len": 512,
                "agent": {
                    "environment": {"triple": "named_envs.py:Doubler", "echo": "named_envs.py:Echo"},
                    "environment_kwargs": {"triple": {"factor": 3}},
                    "chat_template": True,
                    **agent,
                },
            },
            "base_dir": str(tmp_path),
        }
    )


def _tok() -> Any:
    tok = tiny_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE  # renders the tools' names
    return tok


def test_each_row_shows_its_environments_tools_and_each_episode_runs_in_its_environment(tmp_path: Path) -> None:
    config = _config(tmp_path)
    tok = _tok()
    pre = preflight(config, tokenizer=tok, data=ROWS)
    rows = pre.datasets["data.path"].rows
    for row in rows:  # TRL renders each prompt with its own environment's tools
        tool, other = ("echo", "double") if row.meta["environment"] == "echo" else ("double", "echo")
        assert row.prompt.startswith(f"system: tools: {tool}user:") and other not in row.prompt, row.prompt

    agent = config.rollout.agent
    assert agent is not None
    factory = load_environments(agent.environment, kwargs=agent.environment_kwargs, base_dir=str(tmp_path))
    assert isinstance(factory, EnvironmentRouter)
    # each episode calls both tools: only its own environment's exists, and its score
    # takes its environment_kwargs (the triple environment's factor 3)
    turns = {i: _call("echo", value=i) + tok.eos_token + _call("double", value=3 * i) + tok.eos_token for i in range(4)}

    def generate(prompts: list[list[int]], params: SamplingParams) -> Any:
        texts = [tok.decode(p) for p in prompts]
        said = [turns[int(t.split("user: q")[1][0])] if "<tool_call>" not in t else "done" for t in texts]
        out = sequence_batch(prompts, [tok.encode(t, add_special_tokens=False) for t in said], tok.pad_token_id)
        out["rollout_log_probs"] = torch.zeros(out["input_ids"].shape)
        out["finish_reason"] = ["stop"] * len(prompts)
        return out

    runner = EpisodeRunner(generate, tok, factory, RunnerLimits(max_turns=3, max_model_len=512), chat_template=True)
    prompts = PromptBatch(rows=list(rows), indices=list(range(len(rows))), epoch=0)
    tasks = episode_prompt_batch(prompts, "answer").meta["task"]
    episodes, _ = runner.run(prompts.prompt_ids, tasks, SamplingParams(n=1, max_tokens=128))
    for i, ep in enumerate(episodes):
        assert ep.error is None, ep.error
        calls = {c["name"]: c["ok"] for c in ep.record()["calls"]}
        own = "echo" if i % 2 else "double"
        assert calls == {"echo": own == "echo", "double": own == "double"}, calls
        assert ep.segments[-1].reward == 1.0  # its own environment, with its kwargs, scored it
        # reset's text of the environment the row names joined its prompt
        assert tok.decode(ep.prompt_ids).endswith(f"user: q{i}{'' if i % 2 else ' Double it.'}\nassistant: ")


def test_a_row_naming_no_environment_is_refused_with_its_row(tmp_path: Path) -> None:
    config = _config(tmp_path)
    for bad, said in (({"environment": "search"}, "got 'search'"), ({}, "got nothing")):
        rows = [ROWS[0], {**{k: v for k, v in ROWS[1].items() if k != "environment"}, **bad}]
        with pytest.raises(ConfigError) as err:
            preflight(config, tokenizer=_tok(), data=rows)
        assert "row 2" in str(err.value) and said in str(err.value), str(err.value)
        assert "one of triple, echo" in str(err.value)
    router = EnvironmentRouter({"echo": lambda: None}, key="env")
    with pytest.raises(Exception, match="the row's 'env' column names its environment, one of echo.*says 'x'"):
        router.for_task({"env": "x"})


def test_the_table_of_environments_is_checked_with_its_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="environment_kwargs: 'search' is not an environment"):
        AgentConfig(environment={"echo": "m:E"}, environment_kwargs={"search": {}})
    with pytest.raises(ValueError, match="environment_kwargs.echo must be a table"):
        AgentConfig(environment={"echo": "m:E"}, environment_kwargs={"echo": 3})
    with pytest.raises(ValueError, match="the table of environments is empty"):
        AgentConfig(environment={})
    config = _config(tmp_path)
    assert config.rollout.agent is not None
    config.rollout.agent.environment = {"triple": "named_envs.py:Missing", "echo": "named_envs.py:Echo"}
    with pytest.raises(ConfigError, match="triple = 'named_envs.py:Missing'.*no attribute 'Missing'"):
        preflight(config, tokenizer=_tok(), data=ROWS)
