"""What an agent builder tripped on (issue 34, items 9-14): an environment file that does not
import, a helper module next to it, failures that print nothing, episodes.log and
completions.jsonl, SFT traces that cannot be trained on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from geartrain.agents import load_environment
from geartrain.cli import main
from geartrain.errors import GeartrainError

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
