"""A callback that keeps its own state in the checkpoint ``on_save`` hands it (issue 35, round
14; what TRL users do in ``on_save``) made every checkpoint "damaged" (a file its manifest does
not list): ``--resume`` and export refused them, advising to start over. What callbacks add is
recorded in the manifest; a file changed afterwards is still damage."""

from __future__ import annotations

from pathlib import Path

import pytest
from geartrain import CheckpointManager
from geartrain.cli import main
from geartrain.manifest import record_new_files, verify_manifest
from geartrain.testing.fakes import FakeBackends, write_fake_job

KEEPS_STATE = """
import json
from pathlib import Path

class KeepState:
    def on_save(self, step, path):
        (Path(path) / "my_state.json").write_text(json.dumps({"step": step}))
"""


def test_files_an_on_save_callback_adds_keep_the_checkpoint_intact(
    fakes: FakeBackends, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "cb.py").write_text(KEEPS_STATE)
    out = tmp_path / "run"
    job = write_fake_job(
        tmp_path,
        out,
        'total_steps = 2\nsave_every = 1\nprogress = false\nexport_hf = false\ncallbacks = ["cb.py:KeepState"]\n',
    )
    assert main(["train", str(job)]) == 0, capsys.readouterr().err
    said = capsys.readouterr().out
    assert said.count("note: the on_save callbacks added my_state.json to step_00000000: recorded in its manifest") == 1
    latest = CheckpointManager(out / "checkpoints" / "actor").latest_intact(print)
    assert latest is not None and latest.name == "step_00000002"
    assert main(["train", str(job), "--resume", "trainer.total_steps=3"]) == 0, capsys.readouterr().err
    assert "is damaged" not in capsys.readouterr().out


def test_recording_new_files_leaves_changed_ones_damaged(tmp_path: Path) -> None:
    checkpoint = CheckpointManager(tmp_path).save(1, lambda d: (d / "weights.bin").write_bytes(b"w" * 10))
    (checkpoint / "extra.txt").write_text("mine")
    assert verify_manifest(checkpoint, exclude=frozenset({"COMPLETE"}))  # unlisted: damaged
    assert record_new_files(checkpoint, exclude=frozenset({"COMPLETE"})) == ["extra.txt"]
    assert verify_manifest(checkpoint, exclude=frozenset({"COMPLETE"})) == []
    assert record_new_files(checkpoint, exclude=frozenset({"COMPLETE"})) == []
    (checkpoint / "weights.bin").write_bytes(b"x" * 10)
    assert record_new_files(checkpoint, exclude=frozenset({"COMPLETE"})) == []
    assert verify_manifest(checkpoint, exclude=frozenset({"COMPLETE"})), "a changed file is still damage"
