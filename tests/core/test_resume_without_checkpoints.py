"""``--resume`` where no checkpoint is left (issue 35, round 11): a finished run whose
``checkpoints/`` had been removed (to save space: ``hf/`` is the finished model) was started
again from scratch, replacing its export and metrics without ``--overwrite`` and without the
usual check of the config against the run's. It is refused now, changing nothing; a run
stopped before its first checkpoint (nothing a restart replaces) still starts over."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from geartrain.cli import main
from geartrain.testing.fakes import FakeBackends, write_fake_job


def _job(tmp_path: Path) -> tuple[Path, Path]:
    out = tmp_path / "run"
    job = write_fake_job(tmp_path, out, "total_steps = 3\nsave_every = 1\nprogress = false\nexport_hf = false\n")
    return job, out


def _tree(out: Path) -> dict[str, str]:
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != ".geartrain.lock"
    }


def _steps(out: Path) -> list[int]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if r.get("phase") == "rl"]


def test_resume_of_a_finished_run_without_checkpoints_is_refused_and_changes_nothing(
    fakes: FakeBackends, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job, out = _job(tmp_path)
    assert main(["train", str(job)]) == 0, capsys.readouterr().err
    assert _steps(out)[-1] == 3
    shutil.rmtree(out / "checkpoints")
    before = _tree(out)
    capsys.readouterr()
    assert main(["train", str(job), "--resume", "trainer.seed=7"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --resume: no complete checkpoint under"), err
    assert "holds the run's metrics of 3 RL step(s) (metrics.jsonl, up to step 3)" in err[0]
    assert "nothing was changed" in err[0] and "--overwrite" in err[0]
    assert _tree(out) == before


def test_resume_of_a_run_stopped_before_its_first_checkpoint_starts_over(
    fakes: FakeBackends, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job, out = _job(tmp_path)
    assert main(["train", str(job)]) == 0, capsys.readouterr().err
    # what a run killed before its first save leaves: its config and the metrics of step 0
    shutil.rmtree(out / "checkpoints")
    metrics = [line for line in (out / "metrics.jsonl").read_text().splitlines() if json.loads(line).get("step") == 0]
    (out / "metrics.jsonl").write_text("\n".join(metrics) + "\n")
    capsys.readouterr()
    assert main(["train", str(job), "--resume"]) == 0, capsys.readouterr().err
    assert "no complete checkpoint under" in capsys.readouterr().out
    assert _steps(out) == [0, 1, 2, 3]


def test_a_final_export_is_named_among_what_a_restart_replaces(tmp_path: Path) -> None:
    from geartrain.trainer.config import load_train_config
    from geartrain.trainer.run import Job

    job, out = _job(tmp_path)
    (out / "hf").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"phase": "rl", "step": 0}\n{"phase": "sft", "step": 5}\nnot json\n')
    replaced = Job(load_train_config(job, check_plugins=False), resume=True)._results_a_restart_replaces()
    assert replaced == ["final export (hf/)"]
