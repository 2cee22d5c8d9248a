"""``geartrain check`` refuses what ``train`` would refuse, and ``--resume`` into a directory
with no run is an error (issue 19, items 11 and 16)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from geartrain.cli import main
from geartrain.testing.fakes import FakeBackends


@pytest.fixture
def fakes():  # noqa: ANN201
    """Recording fake backends: a refused job must not have built anything."""
    with FakeBackends().registered() as backends:
        yield backends


@pytest.fixture
def geartrain(capsys: pytest.CaptureFixture[str], fakes: FakeBackends):  # noqa: ANN201
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        rc = main(list(args))
        out = capsys.readouterr()
        if rc != 0:
            assert fakes.calls == [], "a refused job built something"
        return subprocess.CompletedProcess(["geartrain", *args], rc, out.out, out.err)

    return run


def _job(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "ground_truth": "2"}\n' * 4)
    out = tmp_path / "run"
    job = tmp_path / "job.toml"
    job.write_text(
        '[model]\ntiny = "qwen2"\n[reward]\nfunction = "arithmetic"\n[actor.engine]\nbackend = "fake"\n'
        '[rollout]\nbackend = "fake"\n'
        '[data]\npath = "train.jsonl"\nbatch_size = 2\napply_chat_template = false\n'
        f'[trainer]\noutput_dir = "{out}"\n'
    )
    return job, out


@pytest.mark.parametrize("command", ["check", "train"])
def test_resume_into_a_directory_without_a_run_is_an_error(geartrain, tmp_path: Path, command: str) -> None:
    job, out = _job(tmp_path)
    out.mkdir()
    proc = geartrain(command, str(job), "--resume")
    assert proc.returncode == 2
    assert f"error: nothing to resume in {out}: it holds no run" in proc.stderr
    assert list(out.iterdir()) == []  # nothing was started there


def test_check_refuses_a_directory_that_holds_a_run_unless_told_how(geartrain, tmp_path: Path) -> None:
    job, out = _job(tmp_path)
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    proc = geartrain("check", str(job))
    assert proc.returncode == 2 and "already holds a run (metrics.jsonl)" in proc.stderr
    assert geartrain("check", str(job), "--overwrite").returncode == 0
    assert geartrain("check", str(job), "--resume").returncode == 0


@pytest.mark.parametrize("command", ["check", "train"])
def test_max_model_len_past_the_models_positions_is_refused(geartrain, tmp_path: Path, command: str) -> None:
    job, out = _job(tmp_path)
    proc = geartrain(command, str(job), "rollout.max_model_len=1024")
    assert proc.returncode == 2
    assert "rollout.max_model_len: 1024 exceeds the model's max_position_embeddings=512" in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("command", ["check", "train"])
def test_a_batch_larger_than_the_data_is_refused(geartrain, tmp_path: Path, command: str) -> None:
    job, out = _job(tmp_path)
    proc = geartrain(command, str(job), "data.batch_size=5")
    assert proc.returncode == 2
    assert "data.batch_size: 5 is larger than the 4 prompts of data.path" in proc.stderr
    assert "set data.drop_last=false" in proc.stderr
    assert not out.exists()
    # without drop_last the last batch may be short: both take it
    assert geartrain("check", str(job), "data.batch_size=5", "data.drop_last=false").returncode == 0
