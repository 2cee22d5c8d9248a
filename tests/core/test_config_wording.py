"""Config errors in geartrain's words, never pydantic's (issue 19, item 12): unknown keys get
a "did you mean", a validator's message has no "Value error," prefix and no "<root>", and a
bad command-line override is reported as the override, not as the file."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from geartrain.cli import main
from geartrain.errors import ConfigError
from geartrain.trainer import load_train_config
from geartrain.trainer.config import TrainConfig
from geartrain.trainer.trl_names import TRL_NAMES

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


# ------------------------------------------------------------------ TRL's names
DOC = Path(__file__).resolve().parents[2] / "docs" / "coming_from_trl.md"
KEY_PATH = re.compile(r"[a-z_]+(?:\.[a-z_]+)+")


@pytest.mark.parametrize(
    ("override", "right_key"),
    [
        ("trainer.max_steps=10", "trainer.total_steps"),  # spelling alone said 'max_staleness'
        ("algorithm.beta=0.04", "algorithm.kl_loss_coef"),  # spelling alone said 'dro_beta'
        ("learning_rate=1e-5", "actor.engine.optim.lr"),  # at the top level too
        ("sampling.num_generations=8", "sampling.n"),
        # issue 34 item 6: these got nothing, and logging_steps a "did you mean 'loggers'"
        ("trainer.gradient_accumulation_steps=4", "actor.engine.max_tokens_per_micro_batch"),
        ("trainer.push_to_hub=true", "huggingface-cli upload"),
        ("rollout.vllm_mode=server", "rollout.placement"),
        ("trainer.logging_steps=5", "trainer.progress"),
    ],
)
def test_a_trl_key_name_points_to_geartrains_key(tmp_path: Path, override: str, right_key: str) -> None:
    name = override.split("=")[0].rsplit(".", 1)[-1]
    text = _error(tmp_path, None, [override])
    assert f"unknown key '{name}'; TRL's '{name}' is " in text and right_key in text, text
    assert "did you mean" not in text


def test_one_entry_of_a_list_is_overridden_by_its_index(tmp_path: Path) -> None:
    """``reward.functions.0.function=...`` sets that entry's key and keeps its others (issue
    34 item 6: it was refused, the list being no table); a wrong index is one line."""
    job = tmp_path / "job.toml"
    job.write_text(
        JOB.read_text()
        + '\n[[reward.functions]]\nname = "a"\nfunction = "arithmetic"\nweight = 0.5\n'
        + '[[reward.functions]]\nname = "b"\nfunction = "arithmetic"\n'
    )
    config = load_train_config(job, ["reward.function=null", "reward.functions.0.function=format"], check_plugins=False)
    first, second = config.reward.functions
    assert (first.name, first.function, first.weight) == ("a", "format", 0.5)
    assert (second.name, second.function) == ("b", "arithmetic")
    config = load_train_config(
        job, ["reward.function=null", "reward.functions.2={name = 'c', function = 'format'}"], check_plugins=False
    )
    assert [f.name for f in config.reward.functions] == ["a", "b", "c"]
    text = _error(tmp_path, job.read_text(), ["reward.function=null", "reward.functions.5.weight=2"])
    assert "reward.functions.5.weight: 'reward.functions' is a list of 2: an index is 0 to 1, or 2 to append" in text


def test_an_override_given_twice_is_named_and_the_last_is_used(caplog: pytest.LogCaptureFixture) -> None:
    """Probe of issue 35: ``trainer.total_steps=5 trainer.total_steps=7`` took 7 silently.
    Layering a shared list of overrides and then the differing one is a use, so the last
    still wins, with one warning line naming both."""
    with caplog.at_level("WARNING", logger="geartrain.config"):
        config = load_train_config(
            JOB, ["trainer.total_steps=5", "sampling.n=4", "trainer.total_steps = 7"], check_plugins=False
        )
    assert config.trainer.total_steps == 7
    said = [r.getMessage() for r in caplog.records if r.name == "geartrain.config"]
    assert said == [
        "trainer.total_steps is given twice on the command line ('trainer.total_steps=5', then "
        "'trainer.total_steps = 7'); the last is used"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="geartrain.config"):
        load_train_config(JOB, ["trainer.total_steps=5", "sampling.n=4"], check_plugins=False)
    assert not [r for r in caplog.records if r.name == "geartrain.config"]


def test_a_trl_name_in_a_job_file_gets_the_same_answer_and_typos_still_get_did_you_mean(tmp_path: Path) -> None:
    text = _error(tmp_path, "[trainer]\nmax_steps = 3\nmax_stalenes = 1\n", [])
    assert "trainer.max_steps: unknown key 'max_steps'; TRL's 'max_steps' is trainer.total_steps" in text
    assert "trainer.max_stalenes: unknown key 'max_stalenes'; did you mean 'max_staleness'?" in text


def _trl_table() -> list[tuple[str, str]]:
    """``(TRL cell, geartrain cell)`` of each row of the guide's table of equivalent options."""
    text = DOC.read_text().split("## Equivalent options", 1)[1]
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and not line.startswith("|--")]
    return [(cells[0][2:], cells[1]) for cells in rows[1:]]


def test_the_trl_names_table_and_the_guides_table_agree() -> None:
    """TRL_NAMES is the one source: each name is in the guide's table with every key path it
    names; each TRL option the guide lists by a bare name is in TRL_NAMES; every key path
    is a real field of a job."""
    table = _trl_table()
    for name, target in TRL_NAMES.items():
        rows = [gear for trl, gear in table if re.search(rf"`{name}(`|=| )", trl)]
        assert rows, f"docs/coming_from_trl.md has no row for TRL's '{name}'"
        for path in KEY_PATH.findall(target):
            assert any(path in gear for gear in rows), f"the guide's row for '{name}' does not name {path}"
    options = [trl for trl, _ in table if not trl.startswith("dataset column")]  # columns are not options
    bare = {m for trl in options for m in re.findall(r"`([a-z_]+)`", trl)}
    assert bare - set(TRL_NAMES) == set(), "TRL options in the guide that TRL_NAMES lacks"
    for path in {p for target in TRL_NAMES.values() for p in KEY_PATH.findall(target)}:
        node: type = TrainConfig
        for part in path.split("."):
            assert part in node.model_fields, f"{path}: '{part}' is not a key"  # type: ignore[attr-defined]
            annotation = node.model_fields[part].annotation  # type: ignore[attr-defined]
            # an optional section (rollout.agent: AgentConfig | None) is walked as its model
            models = [a for a in (typing.get_args(annotation) or (annotation,)) if isinstance(a, type)]
            node = next((a for a in models if hasattr(a, "model_fields")), models[0] if models else type(None))


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("deep.toml", "x = " + "[" * 100000 + "]" * 100000 + "\n", "values nested too deeply"),
        ("deep.yaml", "x: " + "[" * 100000 + "]" * 100000 + "\n", "values nested too deeply"),
        ("big.toml", "[trainer]\ntotal_steps = " + "9" * 5000 + "\n", "Exceeds the limit (4300 digits)"),
        ("big.yaml", "trainer:\n  total_steps: " + "9" * 5000 + "\n", "Exceeds the limit (4300 digits)"),
    ],
    ids=["deep-toml", "deep-yaml", "bigint-toml", "bigint-yaml"],
)
def test_a_job_file_its_parser_refuses_in_any_way_is_one_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str, says: str
) -> None:
    """Probe rerun for issue 35 item 13 (probes5): a job file nesting arrays 100000 deep
    (RecursionError, about 2990 lines of traceback) or holding a 5000-digit integer
    (ValueError, 43-54 lines) ended ``geartrain config`` with exit 1."""
    path = tmp_path / name
    path.write_text(text)
    assert main(["config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"cannot parse: {says}" in err, err


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("9" * 5000, "cannot read the value: Exceeds the limit (4300 digits)"),
        ("[" + "9" * 5000 + "]", "cannot read the value: Exceeds the limit (4300 digits)"),
        ("[" * 3000, "the value is nested too deeply"),
    ],
    ids=["bigint", "bigint-in-list", "deep"],
)
def test_an_override_value_its_parser_refuses_in_any_way_is_one_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, says: str
) -> None:
    """Probe of issue 35 round 8 (probes8): the job file's case above, given on the command
    line: ``trainer.total_steps=<5000 digits>`` or ``trainer.loggers=[[[...`` ended
    ``geartrain config``/``check``/``train`` with a ValueError/RecursionError traceback, exit 1."""
    path = tmp_path / "job.toml"
    path.write_text("[trainer]\ntotal_steps = 3\n")
    assert main(["config", str(path), f"trainer.total_steps={value}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"trainer.total_steps: {says}" in err, err
    assert "set_int_max_str_digits" not in err, err


def test_a_job_file_that_is_a_pipe_is_named_as_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Probe rerun for issue 35 item 13 (probes5): a FIFO named job.toml was refused as 'a
    directory'; it is said to be a pipe (and nothing is read from it: that would block)."""
    import os

    fifo = tmp_path / "job.toml"
    os.mkfifo(fifo)
    assert main(["config", str(fifo)]) == 2
    assert "is not a regular file (a pipe, device or socket)" in capsys.readouterr().err


def test_a_yaml_key_given_twice_is_refused_naming_both_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Probe rerun for issue 35 (probes5 leftover): a YAML job file giving a key twice ran with
    the last value silently (TOML refuses it). A YAML merge key still overrides, as YAML says."""
    path = tmp_path / "job.yaml"
    path.write_text("trainer:\n  total_steps: 3\n  seed: 1\n  total_steps: 5\n")
    assert main(["config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "cannot parse: line 4: key 'total_steps' is given twice (first on line 2); keep one" in err, err
    path.write_text("base: &b {total_steps: 3, seed: 1}\ntrainer:\n  <<: *b\n  total_steps: 5\n")
    from geartrain.config import read_config_file

    assert read_config_file(path)["trainer"] == {"total_steps": 5, "seed": 1}


def test_bench_without_a_measurement_names_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    """Probe rerun for issue 35 (probes5 leftover): ``geartrain bench`` alone said 'the
    following arguments are required: bench', naming the command itself, not ``memory``."""
    with pytest.raises(SystemExit) as info:
        main(["bench"])
    assert info.value.code == 2
    assert "the following arguments are required: {memory}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["train"], "geartrain train: error: the following arguments are required: config\n"),
        (["check"], "geartrain check: error: the following arguments are required: config\n"),
        (["config", "job.toml", "--bogus"], "geartrain config: error: unrecognized arguments: --bogus\n"),
        (["plugins", "--format", "xml"], "geartrain plugins: error: unrecognized arguments: --format xml\n"),
        (["bench", "memory", "--preset", "x"], "geartrain bench memory: error: unrecognized arguments: --preset\n"),
    ],
    ids=["train-alone", "check-alone", "config-unknown-option", "plugins-unknown-option", "bench-unknown-option"],
)
def test_a_command_line_mistake_is_told_by_that_command(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Probes7 (issue 35): ``geartrain train`` alone said 'the following arguments are required:
    config, overrides' (overrides are optional), and an unknown option after a command was
    answered with the top-level usage as 'geartrain: error', not the command's own."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.endswith(says), err
    assert err.startswith(f"usage: geartrain {argv[0]}")


@pytest.mark.parametrize(
    ("override", "key", "text"),
    [
        ("trainer.output_dir=007", "trainer.output_dir", "007"),
        ("trainer.output_dir=1e3", "trainer.output_dir", "1e3"),
        ("data.prompt_key=on", "prompt_key", "on"),
        ("data.answer_key=1_000", "answer_key", "1_000"),
    ],
)
def test_a_text_setting_takes_an_override_as_typed(override: str, key: str, text: str) -> None:
    """Issue 35, round 11: an override of a text setting whose value reads as a number or a
    bool (``007`` as 7, ``on`` as true) was refused as "should be a valid string; got 7";
    it is the text as typed (leading zeros kept)."""
    config = load_train_config(JOB, [override], check_plugins=False)
    section = config.trainer if key == "trainer.output_dir" else config.data
    assert getattr(section, key.rsplit(".", 1)[-1]) == text


def test_a_number_setting_still_refuses_text_and_a_text_setting_a_list() -> None:
    with pytest.raises(ConfigError, match="trainer.total_steps: should be a valid integer"):
        load_train_config(JOB, ["trainer.total_steps=abc"], check_plugins=False)
    with pytest.raises(ConfigError, match="trainer.output_dir: should be a valid string"):
        load_train_config(JOB, ["trainer.output_dir=[1, 2]"], check_plugins=False)


BOMB = """model: {tiny: qwen2}
reward: {function: arithmetic}
rollout:
  options:
    a: &a ["x","x","x","x","x","x","x","x","x","x"]
    b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]
    c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]
    d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]
    e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]
    f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e]
    g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f,*f]
    h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g,*g]
    i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def test_a_yaml_alias_bomb_is_refused_before_anything_expands_it(tmp_path: Path) -> None:
    """Issue 35, round 12: a 900-byte YAML job whose nested aliases stand for 10^9 values
    passed ``check --config-only``; ``geartrain config`` (and train's config.json) then wrote
    it out until memory ran out."""
    job = tmp_path / "bomb.yaml"
    job.write_text(BOMB)
    with pytest.raises(ConfigError, match=r"expands to more than 1,000,000 values \(YAML aliases"):
        load_train_config(job, check_plugins=False)
    # an alias used as aliases usually are (a shared list, a few times) is fine
    job.write_text(BOMB.split("    c:")[0])
    assert load_train_config(job, check_plugins=False).rollout.options["b"][0] == ["x"] * 10


def test_a_job_file_that_is_a_loop_of_symbolic_links_is_one_line(tmp_path: Path) -> None:
    """Issue 35, round 13: ``geartrain check a.toml`` where a.toml -> b.toml -> a.toml was a
    33-line traceback (RuntimeError: Symlink loop), exit 1."""
    from geartrain.errors import ConfigError
    from geartrain.trainer import load_train_config

    (tmp_path / "a.toml").symlink_to(tmp_path / "b.toml")
    (tmp_path / "b.toml").symlink_to(tmp_path / "a.toml")
    with pytest.raises(ConfigError) as info:
        load_train_config(tmp_path / "a.toml")
    assert "cannot be read (Symlink loop from" in str(info.value), str(info.value)
