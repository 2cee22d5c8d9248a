"""Config errors in geartrain's words, never pydantic's (issue 19, item 12): unknown keys get
a "did you mean", a validator's message has no "Value error," prefix and no "<root>", and a
bad command-line override is reported as the override, not as the file."""

from __future__ import annotations

from pathlib import Path

import pytest
from geartrain.cli import main
from geartrain.errors import ConfigError
from geartrain.trainer import load_train_config

JOB = Path(__file__).resolve().parents[2] / "examples" / "arithmetic" / "grpo.toml"
PYDANTIC = ("Extra inputs are not permitted", "Value error", "Input should", "<root>", "Field required")


def _error(tmp_path: Path, toml: str | None, overrides: list[str]) -> str:
    path = JOB
    if toml is not None:
        path = tmp_path / "job.toml"
        path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_train_config(path, overrides, check_plugins=False)
    text = str(info.value)
    assert not [w for w in PYDANTIC if w in text], text
    return text


def test_unknown_keys_get_did_you_mean(tmp_path: Path) -> None:
    text = _error(tmp_path, "[trainer]\ntotal_step = 3\n[actor.engine.optim]\nlrr = 1e-5\n", [])
    assert f"invalid configuration in {tmp_path / 'job.toml'}: 2 problem(s)" in text
    assert "trainer.total_step: unknown key 'total_step'; did you mean 'total_steps'?" in text
    assert "actor.engine.optim.lrr: unknown key 'lrr'; did you mean 'lr'?" in text
    text = _error(tmp_path, "[sampling]\nzzz = 1\n", [])
    assert "sampling.zzz: unknown key 'zzz'; the keys here are: n, temperature" in text


def test_a_bad_override_is_reported_as_the_override_not_the_file(tmp_path: Path) -> None:
    text = _error(tmp_path, None, ["trainer.total_steps=abc", "sampling.n=0"])
    assert text.startswith("invalid configuration in command-line overrides: 2 problem(s)")
    assert (
        "trainer.total_steps: should be a valid integer, unable to parse string as an integer; got 'abc' "
        "(the command-line override 'trainer.total_steps=abc')" in text
    )
    assert "sampling.n: should be greater than or equal to 1; got 0 (the command-line override 'sampling.n=0')" in text
    assert str(JOB) not in text


def test_a_validators_message_has_no_pydantic_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = _error(tmp_path, '[model]\ntiny = "qwen2"\npath = "x"\n', [])
    assert "model: set exactly one of 'path'" in text
    text = _error(
        tmp_path,
        '[model]\ntiny = "qwen2"\n[rollout]\nmax_model_len = 8\n'
        "[sampling]\nmax_tokens = 4\n[data]\nmax_prompt_length = 6\n",
        [],
    )
    assert "data.max_prompt_length (6) + sampling.max_tokens (4) = 10 exceeds rollout.max_model_len (8)" in text
    assert main(["check", str(JOB), "reward.functions=[{name = 'a'}]", "--config-only", "--no-plugins"]) == 2
    err = capsys.readouterr().err
    assert "reward.functions[0].function: required, not set (the command-line override" in err
