"""What ``geartrain export`` takes as its source (issue 35, round 12): the critic's
checkpoint of a PPO run was exported as a causal LM (a value model written as
``Qwen2ForCausalLM`` with a text-generation card, exit 0); a complete checkpoint copied to a
directory not named ``step_N`` (``best``) failed with a traceback ("invalid literal for
int()")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from geartrain import CheckpointManager
from geartrain.checkpoint import misnamed
from geartrain.errors import CheckpointError
from geartrain.trainer.export import run_of


def _ppo_run(out: Path) -> None:
    (out / "config.json").parent.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    for role in ("actor", "critic"):
        CheckpointManager(out / "checkpoints" / role).save(
            4, lambda d: (d / "engine.json").write_text(json.dumps({"step": 4}))
        )


def test_the_critics_checkpoint_is_refused_naming_the_actors(tmp_path: Path) -> None:
    _ppo_run(tmp_path / "run")
    critic = tmp_path / "run" / "checkpoints" / "critic" / "step_00000004"
    with pytest.raises(CheckpointError) as err:
        run_of(critic)
    message = str(err.value)
    assert message.startswith(f"{critic} is the critic's checkpoint (a value model), not the policy's")
    assert f"{(tmp_path / 'run').resolve()}/checkpoints/actor/step_00000004" in message
    actor = tmp_path / "run" / "checkpoints" / "actor" / "step_00000004"
    assert run_of(actor) == (actor, (tmp_path / "run").resolve())


@pytest.mark.parametrize("name", ["best", ".partial-step_00000004"])
def test_a_checkpoint_copied_under_another_name_is_not_misnamed(tmp_path: Path, name: str) -> None:
    _ppo_run(tmp_path / "run")
    copy = tmp_path / name
    shutil.copytree(tmp_path / "run" / "checkpoints" / "actor" / "step_00000004", copy)
    assert misnamed(copy) == []  # its name claims no step: engine.json's is the one
    assert misnamed(tmp_path / "run" / "checkpoints" / "actor" / "step_00000004") == []


def test_export_of_a_run_whose_checkpoints_are_all_damaged_gives_an_exports_advice(tmp_path: Path) -> None:
    """Issue 35, round 13: the refusal advised "start a fresh run with --overwrite" (training
    advice, for an export) and did not mention the run's intact final export in hf/."""
    run = tmp_path / "run"
    _ppo_run(run)
    (run / "checkpoints" / "actor" / "step_00000004" / "engine.json").write_text("{}")  # not what the manifest says
    (run / "hf").mkdir()
    (run / "hf" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError) as err:
        run_of(run, echo=lambda line: None)
    message = str(err.value)
    assert "--overwrite" not in message and "fresh run" not in message, message
    assert f"nothing to export from them; the run's final model is exported already, in {run / 'hf'}" in message


def test_a_new_export_of_the_run_clears_what_the_previous_one_wrote(tmp_path: Path) -> None:
    """Issue 35, round 14: a LoRA run exported with ``export_merged = true`` and resumed with
    it off wrote the step-6 adapter beside step 4's ``merged/``, which the new export's record
    then listed as its own."""
    from geartrain.trainer.export import EXPORT_RECORD, clear_previous_export, write_export_record

    hf = tmp_path / "hf"
    (hf / "merged").mkdir(parents=True)
    (hf / "merged" / "model.safetensors").write_bytes(b"step 4")
    (hf / "adapter_model.safetensors").write_bytes(b"step 4")
    write_export_record(hf, 4, tmp_path)
    (hf / "NOTES.md").write_text("the user's own")  # written after the export: not the export's
    assert clear_previous_export(hf) == ["adapter_model.safetensors", "merged"]
    assert sorted(p.name for p in hf.iterdir()) == ["NOTES.md"]
    assert not (hf / EXPORT_RECORD).exists()
    assert clear_previous_export(tmp_path / "nothing-here") == []
