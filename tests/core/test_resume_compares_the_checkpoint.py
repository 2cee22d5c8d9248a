"""What ``--resume`` compares a new config with (issue 35, round 13): the config each
checkpoint was saved with (in its engine record), not the run's ``config.json``, which a hand
edit changed unnoticed (the refusal then blamed the command line for the run's own settings);
an edit is said. A setting of a warm start the run never had (``sft.enabled = false``) is no
reason to refuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from geartrain.cli import main
from geartrain.testing.fakes import FakeBackends, write_fake_job
from geartrain.trainer.config_diff import diff_configs


def test_resume_compares_with_the_checkpoints_config_and_names_a_hand_edit(
    fakes: FakeBackends, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    job = write_fake_job(tmp_path, out, "total_steps = 2\nsave_every = 1\nprogress = false\nexport_hf = false\n")
    assert main(["train", str(job)]) == 0, capsys.readouterr().err
    saved = json.loads((out / "config.json").read_text())
    saved["trainer"]["seed"] = 7
    saved["algorithm"]["clip_ratio"] = 0.5
    (out / "config.json").write_text(json.dumps(saved))
    capsys.readouterr()
    assert main(["train", str(job), "--resume", "trainer.total_steps=3"]) == 0, capsys.readouterr().err
    said = capsys.readouterr().out
    assert (
        f"--resume: {out / 'config.json'} differs from the config step_00000002 was saved with in "
        "algorithm.clip_ratio, trainer.seed (edited since?); the checkpoint's is the one compared"
    ) in said, said
    assert json.loads((out / "config.json").read_text())["trainer"]["seed"] != 7  # written again, as run

    capsys.readouterr()
    assert main(["train", str(job), "--resume", "trainer.total_steps=4", "algorithm.clip_ratio=0.5"]) == 2
    err = capsys.readouterr().err
    assert "algorithm.clip_ratio: 0.2 -> 0.5: refused" in err, err


def test_a_warm_start_setting_of_a_run_without_one_is_no_reason_to_refuse() -> None:
    saved = {"sft": {"enabled": False, "seed": 0}, "trainer": {"seed": 0}}
    changes = {c.key: c for c in diff_configs(saved, {"sft": {"enabled": False, "seed": 7}, "trainer": {"seed": 0}})}
    assert changes["sft.seed"].verdict == "applied", changes
    on = {"sft": {"enabled": True, "seed": 0}}
    assert diff_configs(on, {"sft": {"enabled": True, "seed": 7}})[0].verdict == "refused"
    assert diff_configs(saved, {"sft": {"enabled": True, "seed": 0}})[0].verdict == "refused"


def test_the_options_of_a_new_rollout_backend_are_one_line_of_the_diff() -> None:
    """Issue 35, round 14: switching rollout.backend from torch to vllm on --resume listed 24
    changes, 22 of them rollout.options keys the user never set (each backend's defaults)."""
    saved = {"rollout": {"backend": "torch", "options": {"a": 1, "b": 2}}, "trainer": {"total_steps": 3}}
    new = {"rollout": {"backend": "vllm", "options": {"seed": 0, "c": 3, "d": 4}}, "trainer": {"total_steps": 4}}
    changes = diff_configs(saved, new)
    assert [c.key for c in changes] == ["rollout.backend", "rollout.options", "trainer.total_steps"]
    assert (changes[1].old, changes[1].new) == ("torch's (2 settings)", "vllm's (3 settings)")
    same = {"rollout": {"backend": "torch", "options": {"a": 1, "b": 5}}, "trainer": {"total_steps": 3}}
    assert [c.key for c in diff_configs(saved, same)] == ["rollout.options.b"], "the same backend: each change"


def test_a_run_resumed_with_tensorboard_off_can_still_be_overwritten(
    fakes: FakeBackends, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 35, round 14: after a resume with ``trainer.tensorboard = false`` (applied),
    ``--overwrite`` called the run's own tensorboard/ "what no training run wrote there" and
    refused: config.json no longer said the run wrote it. Its checkpoints' configs do."""
    out = tmp_path / "run"
    job = write_fake_job(tmp_path, out, "total_steps = 2\nsave_every = 1\nprogress = false\nexport_hf = false\n")
    assert main(["train", str(job), "trainer.tensorboard=true"]) == 0, capsys.readouterr().err
    assert any((out / "tensorboard").iterdir())
    resumed = ["--resume", "trainer.tensorboard=false", "trainer.total_steps=3"]
    assert main(["train", str(job), *resumed]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["train", str(job), "--overwrite", "trainer.tensorboard=false"]) == 0, capsys.readouterr().err
