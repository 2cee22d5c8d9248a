"""What an agent builder tripped on (issue 34, items 9-14): an environment file that does not
import, a helper module next to it, failures that print nothing, episodes.log and
completions.jsonl, SFT traces that cannot be trained on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from geartrain import SamplingParams
from geartrain.agents import Environment, EpisodeRunner, RunnerLimits, StepResult, ToolEnvironment, load_environment
from geartrain.cli import main
from geartrain.data import DataConfig
from geartrain.errors import DataError, GeartrainError
from geartrain.testing.tiny import tiny_tokenizer
from geartrain.trainer.config import SFTConfig
from geartrain.trainer.episodes import failure_lines
from geartrain.trainer.rundir import RunDirectory
from geartrain.trainer.sft import sft_dataset
from scripted_turns import scripted_generate

ROOT = Path(__file__).resolve().parents[2]
GUESS = ROOT / "examples" / "guess_number" / "grpo.toml"


@pytest.fixture
def geartrain(capsys: pytest.CaptureFixture[str]):  # noqa: ANN201
    """``geartrain ARGS`` through the CLI's entry point, in this process: (rc, stdout, stderr)."""

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        rc = main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["geartrain", *args], rc, out.out, out.err)

    return run


# ----------------------------------------------------------------------------- item 10


def test_an_environment_file_that_fails_to_import_is_one_line_from_check(tmp_path: Path, geartrain) -> None:  # noqa: ANN001
    env = tmp_path / "my_env.py"
    env.write_text("import os\nimport no_such_module_for_geartrain\n")
    proc = geartrain("check", str(GUESS), "--no-plugins", f"rollout.agent.environment={env}:Env")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if "rollout.agent.environment" in x]
    assert line.strip() == (
        f"rollout.agent.environment: environment file '{env}' failed to import (line 2): "
        f"ModuleNotFoundError: No module named 'no_such_module_for_geartrain' "
        f"(rollout.agent.environment = '{env}:Env')"
    )


def test_a_syntax_error_names_its_line(tmp_path: Path) -> None:
    (tmp_path / "env.py").write_text("x = 1\ndef broken(:\n")
    with pytest.raises(GeartrainError, match=r"failed to import \(line 2\): SyntaxError"):
        load_environment("env.py:Env", base_dir=str(tmp_path))


def test_a_module_next_to_the_environment_file_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "agent_helpers_34.py").write_text(
        "from geartrain.agents import Environment, StepResult\n"
        "class Base(Environment):\n"
        "    def reset(self, task):\n        return 'hello'\n"
        "    def step(self, action):\n        return StepResult(done=True, reward=2.0)\n"
    )
    (tmp_path / "env.py").write_text("from agent_helpers_34 import Base\n\nclass Env(Base):\n    pass\n")
    env = load_environment("env.py:Env", base_dir=str(tmp_path))()
    assert env.reset({}) == "hello" and env.step("x").reward == 2.0


# ----------------------------------------------------------------------------- item 11


def _records(env_factory, model_turns: list[str], episodes: int = 2) -> list[dict]:  # noqa: ANN001
    """The records of ``episodes`` episodes of ``env_factory``, each with ``model_turns``."""
    tok = tiny_tokenizer()
    records = []
    for _ in range(episodes):
        runner = EpisodeRunner(
            scripted_generate(tok, list(model_turns)), tok, env_factory, RunnerLimits(max_turns=3, max_model_len=128)
        )
        (ep,), _ = runner.run([tok.encode("q=", add_special_tokens=False)], [{"prompt": "q="}], SamplingParams())
        records.append(ep.record())
    return records


def _broken(expression: str) -> str:
    """Always fails."""
    raise RuntimeError("no network")


def test_a_tool_failing_on_every_call_and_a_raising_environment_are_one_console_line_each() -> None:
    tools = _records(
        lambda: ToolEnvironment([_broken], call_format="compact", timeout_s=5.0), ["[_broken 1]", "[_broken 2]", "9"]
    )
    assert failure_lines(tools) == [
        "tool '_broken' failed 4 of its 4 calls (agent/tool_errors); first: RuntimeError: no network"
    ]

    class Raises(Environment):
        def reset(self, task: dict) -> str:
            return ""

        def step(self, action: str) -> StepResult:
            raise ValueError("the sandbox is gone")

    failing = _records(Raises, ["1"]) + tools
    assert failure_lines(failing) == [
        "environment error in 2 of 4 episodes (ValueError; agent/env_errors): ValueError: the sandbox is gone",
        "tool '_broken' failed 4 of its 4 calls (agent/tool_errors); first: RuntimeError: no network",
    ]
    assert failure_lines(_records(Raises, ["1"])[:0]) == []


# ----------------------------------------------------------------------------- item 12


def test_overwrite_removes_episodes_log(tmp_path: Path) -> None:
    (tmp_path / "episodes.log").write_text("--- step 0: validation episode(s) ---\n")
    (tmp_path / "config.json").write_text('{"trainer": {}, "actor": {}}')  # a run's (a model's is refused)
    run = RunDirectory(tmp_path, overwrite=True)
    try:
        assert "episodes.log" in run.claim()
    finally:
        run.release()
    assert not (tmp_path / "episodes.log").exists()


# ----------------------------------------------------------------------------- item 14


@pytest.mark.parametrize(
    ("turns", "expected"),
    [
        ([], "'turns' is empty: a trace needs at least one model turn"),
        (
            [{"role": "model", "text": "[calc 2*3]"}, {"role": "observation", "text": "(6)"}],
            "'turns' ends on an observation (turn 2): a trace ends on a model turn",
        ),
    ],
    ids=["empty", "ends-on-observation"],
)
def test_a_trace_that_cannot_be_trained_on_is_refused_with_its_row(tmp_path: Path, turns: list, expected: str) -> None:
    good = {"prompt": "2*3=", "turns": [{"role": "model", "text": "6"}]}
    path = tmp_path / "traces.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({"prompt": "2*3=", "turns": turns}) + "\n")
    tok = tiny_tokenizer()
    data = DataConfig(apply_chat_template=False)
    with pytest.raises(DataError) as caught:
        sft_dataset(SFTConfig(enabled=True, path=str(path)), str(path), tok, data)
    assert str(caught.value).startswith(f"{path}, line 2: {expected}")
    path.write_text(json.dumps(good) + "\n")
    assert len(sft_dataset(SFTConfig(enabled=True, path=str(path)), str(path), tok, data).rows) == 1


# ----------------------------------------------------------------------------- item 13


def _now() -> str:
    """The time."""
    return "noon"


def _add(a: str, b: str) -> str:
    """Add two numbers."""
    return str(int(a) + int(b))


def _upper(text: str, suffix: str = "!") -> str:
    """Shout."""
    return text.upper() + suffix


@pytest.mark.parametrize(
    ("turn", "observation"),
    [
        ("[_upper  a b ]", "(A B!)"),  # the text after the name's space, stripped, is the first argument
        ("so: [_upper x]", "(X!)"),  # text before the call is ignored
        ("[_now]", "(noon)"),  # no text: no argument
        ("[_upper]", "(error: tool '_upper' needs argument 'text')"),
        ("[_add 1 2]", "(error: tool '_add' needs argument 'b')"),  # a second required argument: use hermes
        ("[_upper x", "(error: malformed call)"),
        ("[nope 1]", "(error: unknown tool 'nope' (tools: _now, _add, _upper))"),
    ],
)
def test_the_compact_call_format_as_docs_agents_md_states_it(turn: str, observation: str) -> None:
    env = ToolEnvironment([_now, _add, _upper], call_format="compact", timeout_s=5.0)
    assert env.stop_texts == ["]"]
    assert env.step(turn).observation == observation
