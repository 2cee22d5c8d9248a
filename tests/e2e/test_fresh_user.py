"""A fresh user's task (issue 19, "how it is judged"): a directory with only a JSONL file,
a 10-line reward file and a 10-line TOML (``examples/reverse_word``) trains to a stated
gain on the tiny model, through the CLI and through ``run_job`` with a
``datasets.Dataset`` (same seed, same rows: the same curve)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from e2e_helpers import ROOT, run_geartrain
from geartrain.trainer import load_train_config, run_job

TASK = ROOT / "examples" / "reverse_word"
FAST = ["trainer.progress=false", "trainer.plot=false", "trainer.export_hf=false", "trainer.tensorboard=false"]


def _curve(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["reward/mean"] for r in records if r["phase"] == "rl" and r["step"] >= 1]


def _gain(curve: list[float]) -> tuple[float, float]:
    return sum(curve[:5]) / 5, sum(curve[-5:]) / 5


@pytest.mark.e2e
@pytest.mark.slow
def test_a_fresh_task_trains_via_cli_and_run_job_with_a_dataset(tmp_path: Path) -> None:
    import datasets

    task = tmp_path / "task"
    task.mkdir()
    for name in ("words.jsonl", "reward.py", "job.toml"):  # the user's whole directory
        shutil.copy(TASK / name, task / name)
    assert len((task / "reward.py").read_text().splitlines()) <= 10
    assert len((task / "job.toml").read_text().splitlines()) <= 10

    cli = run_geartrain("train", str(task / "job.toml"), *FAST, f"trainer.output_dir={tmp_path / 'cli'}", cwd=task)
    assert cli.returncode == 0, cli.stderr[-3000:]
    first, last = _gain(_curve(tmp_path / "cli"))
    # the stated gain: the mean reward of the last 5 of 30 steps is at least twice the first 5's
    assert last >= 2 * first and last > first + 0.03, (first, last)

    sys.path.insert(0, str(task))
    try:
        from reward import score
    finally:
        sys.path.remove(str(task))
    rows = datasets.Dataset.from_list([json.loads(line) for line in (task / "words.jsonl").read_text().splitlines()])
    config = load_train_config(task / "job.toml", [*FAST, f"trainer.output_dir={tmp_path / 'api'}", "data.path=null"])
    run_job(config, data=rows, reward_fn=score)
    assert _curve(tmp_path / "api") == pytest.approx(_curve(tmp_path / "cli"), abs=1e-6)
