"""FSDP checkpoints never run code when loaded, and a damaged DCP shard is named, not
loaded (issue 10, items 2 and 3, with the real engine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from geartrain import CheckpointError, CheckpointManager
from geartrain.manifest import write_manifest

from .common import full_params, make_batch, make_engine, token_mean_loss


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (open, (str(self.marker), "w"))


def _train_and_save(engine, manager: CheckpointManager, step: int) -> dict[str, torch.Tensor]:  # noqa: ANN001
    engine.forward_backward(make_batch(step), token_mean_loss)
    engine.optimizer_step()
    engine.save_checkpoint(manager, step, {"step": step})
    return full_params(engine)


def test_resume_never_runs_code_planted_in_trainer_pt(tmp_path: Path) -> None:
    engine = make_engine("qwen2")
    path = engine.save_checkpoint(CheckpointManager(tmp_path), 1, {"step": 1})
    state = torch.load(path / "trainer.pt", weights_only=True)
    marker = tmp_path / "pwned"
    state["extra"]["evil"] = _Payload(marker)
    torch.save(state, path / "trainer.pt")
    write_manifest(path, exclude=frozenset({"COMPLETE"}))  # the attacker also rewrites the manifest
    with pytest.raises(CheckpointError, match=r"trainer\.pt: refusing to load it"):
        engine.load_checkpoint(path)
    assert not marker.exists(), "the payload ran"
    rng = torch.load(path / "rng" / "rank_0.pt", weights_only=True)  # RNG files are plain too
    assert set(rng) >= {"torch", "python", "numpy"}


def test_a_damaged_shard_is_named_and_the_intact_checkpoint_restores_its_weights(tmp_path: Path) -> None:
    engine = make_engine("qwen2")
    manager = CheckpointManager(tmp_path, keep_last=3)
    saved_1 = _train_and_save(engine, manager, 1)
    _train_and_save(engine, manager, 2)
    shard = next((tmp_path / "step_00000002" / "dcp").glob("*.distcp"))
    with shard.open("r+b") as fh:  # the probe: 4 KB overwritten inside a .distcp file
        fh.seek(shard.stat().st_size // 2)
        fh.write(b"\x7f" * 4096)
    with pytest.raises(CheckpointError, match=rf"step_00000002 is damaged: dcp/{shard.name} does not match its SHA-256"):
        engine.load_checkpoint(tmp_path / "step_00000002")
    said: list[str] = []
    intact = manager.latest_intact(said.append)
    assert intact == tmp_path / "step_00000001" and shard.name in said[0]
    fresh = make_engine("qwen2")
    assert fresh.load_checkpoint(intact) == {"step": 1}
    for name, tensor in full_params(fresh).items():
        assert torch.equal(tensor, saved_1[name]), name
