"""Problems a user can fix get one clear message, not a traceback; ``geartrain check``
finds them without training (issue 10, items 7, 8 and 9).

The plugins installed here are fakes on purpose: they test the core's plugin loading, not
compute.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest
from geartrain import plugins
from geartrain.cli import main
from geartrain.config import ModelConfig
from geartrain.data import PromptDataset
from geartrain.errors import ConfigError, DataError, PluginError
from geartrain.modeling import load_tokenizer
from geartrain.trainer import load_train_config
from geartrain.trainer.preflight import preflight

ROOT = Path(__file__).resolve().parents[2]
MAIN_CONFIG = ROOT / "examples" / "arithmetic" / "grpo.toml"


@pytest.fixture
def geartrain(capsys: pytest.CaptureFixture[str]):  # noqa: ANN201
    """``geartrain ARGS`` through the CLI's entry point, in this process: (rc, stdout, stderr)."""

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        rc = main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["geartrain", *args], rc, out.out, out.err)

    return run


# ----------------------------------------------------------------------------- item 7


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda d: (d / "job.toml").write_bytes(b"[trainer]\ntotal_steps = 3\n# caf\xe9\n") and d / "job.toml",
            "is not UTF-8 text (byte 0xe9 on line 3)",
        ),
        (lambda d: d, "is a directory, not a config file"),
    ],
    ids=["not-utf8", "directory"],
)
def test_an_unreadable_config_file_is_one_line_rc_2(tmp_path: Path, make, expected: str, geartrain) -> None:  # noqa: ANN001
    path = make(tmp_path)
    proc = geartrain("check", str(path), "--config-only")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: config file {path}: {expected}" + proc.stderr.strip().split(expected, 1)[1]
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_a_config_file_saved_with_a_byte_order_mark_reads_as_without(tmp_path: Path, suffix: str) -> None:
    """Probes7 (issue 35): a job file saved by a Windows editor (UTF-8 with a BOM) was refused as
    "cannot parse: Invalid statement (at line 1, column 1)", naming nothing a user could see."""
    body = "[trainer]\ntotal_steps = 3\n" if suffix == ".toml" else "trainer:\n  total_steps: 3\n"
    path = tmp_path / f"job{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    assert load_train_config(path, check_plugins=False).trainer.total_steps == 3


@pytest.mark.parametrize("key", ["data.path", "sft.path", "reward.function"])
def test_a_path_too_long_for_the_filesystem_is_one_line_rc_2(tmp_path: Path, key: str, geartrain) -> None:  # noqa: ANN001
    """Probes7 (issue 35): a data file, SFT file or reward file named past the filesystem's
    NAME_MAX was a 24-34 line ``OSError: [Errno 36] File name too long``, exit 1."""
    long = tmp_path / ("y" * 300 + (".py" if key == "reward.function" else ".jsonl"))
    value = f"{long}:f" if key == "reward.function" else str(long)
    proc = geartrain(
        "check", str(MAIN_CONFIG), "--no-plugins", f"trainer.output_dir={tmp_path / 'out'}", f"{key}={value}"
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith(f"error: {tmp_path}/yyy") and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.strip().endswith("too long a path (File name too long); give a shorter one")


def test_a_data_file_with_a_non_utf8_byte_names_the_line(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_bytes(b'{"prompt": "1+1=", "ground_truth": "2"}\n{"prompt": "2+2=", "ground_truth": "4\xff"}\n')
    with pytest.raises(DataError, match=r"train\.jsonl, line 2: not UTF-8 \(byte 0xff at column 38\)"):
        PromptDataset(data, load_tokenizer(ModelConfig(tiny="qwen2")))


# ----------------------------------------------------------------------------- item 8


ROW = '{"prompt": "%s", "ground_truth": "1"}\n'


def _job(tmp_path: Path, prompts: list[str], *, max_model_len: int) -> Path:
    """A job file whose data section leaves max_prompt_length at its default (512), so
    only the prompts' real lengths decide whether they fit the rollout."""
    (tmp_path / "train.jsonl").write_text("".join(ROW % p for p in prompts))
    job = tmp_path / "job.toml"
    job.write_text(
        '[model]\ntiny = "qwen2"\n[reward]\nfunction = "arithmetic"\n[data]\npath = "train.jsonl"\n'
        f'batch_size = {len(prompts)}\n[validation]\npath = "train.jsonl"\n'
        f"[rollout]\nmax_model_len = {max_model_len}\n[sampling]\nmax_tokens = 5\n"
    )
    return job


def test_check_finds_a_missing_reward_file_and_data_before_any_training(tmp_path: Path, geartrain) -> None:
    proc = geartrain(
        "check",
        str(MAIN_CONFIG),
        "--no-plugins",
        "--overwrite",
        "reward.function=rewards/missing.py:score",
        f"data.path={tmp_path / 'nope.jsonl'}",
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "reward.function: reward function file" in proc.stderr and "missing.py' does not exist" in proc.stderr
    assert f"data.path: {tmp_path / 'nope.jsonl'}: no such data file" in proc.stderr


def test_check_finds_a_prompt_that_cannot_fit_max_model_len(tmp_path: Path, geartrain) -> None:
    long_prompt = "1+" * 20 + "1="  # 42 characters = 42 tokens of the character tokenizer
    job = _job(tmp_path, ["1+1=", long_prompt, "2+2="], max_model_len=40)
    proc = geartrain("check", str(job), "--no-plugins")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "data.path: 1 of 3 prompts have >= rollout.max_model_len=40 tokens" in proc.stderr
    assert "(longest: 42 tokens, " in proc.stderr and "train.jsonl, line 2)" in proc.stderr
    assert "data.max_prompt_length=35" in proc.stderr and "validation.path: 1 of 3" in proc.stderr


def test_check_notes_prompts_whose_responses_would_be_cut_short(tmp_path: Path) -> None:
    config = load_train_config(_job(tmp_path, ["1+1=", "9" * 30], max_model_len=32), check_plugins=False)
    notes = preflight(config).notes
    assert any("data.path: 1 of 2 prompts leave fewer than 5 tokens" in n and "line 2" in n for n in notes), notes


def test_check_of_the_main_job_parses_its_data_and_resolves_its_reward(geartrain) -> None:
    proc = geartrain(
        "check", str(MAIN_CONFIG), "--no-plugins", "--overwrite"
    )  # whatever a `make train` left in outputs/
    assert proc.returncode == 0, proc.stderr
    assert (
        "checked: reward 'task.py:exact_match' resolves and scores the first rows; data.path 7844 rows" in proc.stdout
    )


def test_preflight_collects_every_problem(tmp_path: Path) -> None:
    config = load_train_config(
        MAIN_CONFIG,
        [
            "reward.function=nope_module:fn",
            f"data.path={tmp_path}/a.jsonl",
            f"validation.path={tmp_path}/b.parquet",
            "sft.path=missing.jsonl",
        ],
        check_plugins=False,
    )
    with pytest.raises(ConfigError) as err:
        preflight(config)
    keys = [key for key, _ in err.value.problems]
    assert keys == ["reward.function", "data.path", "validation.path", "sft.path"]


# ----------------------------------------------------------------------------- item 9


def test_an_allow_list_naming_a_missing_plugin_warns_with_the_installed_names(monkeypatch, caplog) -> None:  # noqa: ANN001
    plugins.clear_cache()
    monkeypatch.setenv(plugins.ALLOW_LIST_ENV, "torch,vlm")
    with caplog.at_level(logging.WARNING, logger="geartrain.plugins"):
        plugins.list_plugins()
        plugins.list_plugins()
    warnings = [r.getMessage() for r in caplog.records if r.name == "geartrain.plugins"]
    assert len(warnings) == 1, warnings  # once, not on every lookup
    assert "GEARTRAIN_PLUGINS='torch,vlm' names 'vlm', which is not installed" in warnings[0]
    assert "installed plugins:" in warnings[0] and "torch" in warnings[0].split("installed plugins:")[1]
    plugins.clear_cache()


def test_a_skeleton_plugin_says_it_is_not_implemented_without_advising_a_reinstall(installed) -> None:  # noqa: ANN001
    installed(
        "gtfake-skeleton",
        "0.0.1",
        {"gtfake_skeleton": "raise NotImplementedError('gtfake-skeleton 0.0.1 is a skeleton: not implemented yet')\n"},
        {"geartrain.engines": {"skel": "gtfake_skeleton"}},
    )
    with pytest.raises(PluginError) as err:
        plugins.load_plugin("engine", "skel")
    message = str(err.value)
    assert "is a skeleton: not implemented yet" in message
    assert "reinstall" not in message and "pip uninstall gtfake-skeleton" in message
