"""User code that calls ``os.chdir`` does not move a run (issue 35, round 11): a reward
function changing the working directory sent the rest of a run with a relative
``trainer.output_dir`` (checkpoints, export, metrics) into that directory without a word,
or made TensorBoard's writer thread fail on a path that no longer resolved. The directory is
changed back after each call, and the function named once."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from geartrain.cli import main
from geartrain.rewards.scoring import RewardScorer
from geartrain.testing.fakes import FakeBackends, write_fake_job
from geartrain.workdir import WorkingDirectoryGuard


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "work").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path / "work"


def test_a_reward_that_changes_directory_is_undone_and_named_once(work: Path, caplog: pytest.LogCaptureFixture) -> None:
    elsewhere = work.parent / "elsewhere"

    def moves(response: str, ground_truth: str, **kwargs: object) -> float:
        os.chdir(elsewhere)
        return 1.0

    scorer = RewardScorer(moves)
    with caplog.at_level(logging.WARNING, logger="geartrain"):
        for _ in range(2):
            assert scorer.score(["a", "b"], ["a", "b"]).scores.tolist() == [1.0, 1.0]
            assert os.getcwd() == str(work)
    said = [r.getMessage() for r in caplog.records if "changed the working directory" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith(f"reward function 'moves' changed the working directory to '{elsewhere}'")
    assert f"changed it back to '{work}'" in said[0]


def test_a_directory_moved_to_and_removed_is_left_too(work: Path, caplog: pytest.LogCaptureFixture) -> None:
    guard = WorkingDirectoryGuard()
    doomed = work.parent / "doomed"
    doomed.mkdir()
    os.chdir(doomed)
    doomed.rmdir()
    with caplog.at_level(logging.WARNING, logger="geartrain"):
        assert guard.restore("a test") is True
    assert os.getcwd() == str(work)
    assert "to a directory since removed" in caplog.text
    assert guard.restore("a test") is False  # nothing to undo now


def test_a_run_with_a_relative_output_dir_stays_where_it_started(
    fakes: FakeBackends, work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The round's probe: a reward that chdirs on every call, ``trainer.output_dir`` relative."""
    elsewhere = work.parent / "elsewhere"
    (work / "moves.py").write_text(
        f"import os\n\ndef moves(response, ground_truth, **kw):\n    os.chdir({str(elsewhere)!r})\n    return 1.0\n"
    )
    write_fake_job(
        work, "run", "total_steps = 3\nsave_every = 1\nexport_hf = false\nprogress = false\n", reward="moves.py:moves"
    )
    assert main(["train", "job.toml"]) == 0, capsys.readouterr().err
    assert os.getcwd() == str(work)
    assert list(elsewhere.iterdir()) == []
    steps = [json.loads(line).get("step") for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 3
    assert sorted(p.name for p in (work / "run" / "checkpoints" / "actor").iterdir())[-1].endswith("3")
