"""FSDP checkpoints never run code when loaded, and a damaged DCP shard is named, not
loaded (issue 10, items 2 and 3, with the real engine)."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from geartrain import CheckpointError, CheckpointManager
from geartrain.manifest import MANIFEST, write_manifest

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
    with pytest.raises(
        CheckpointError, match=rf"step_00000002 is damaged: dcp/{shard.name} does not match its SHA-256"
    ):
        engine.load_checkpoint(tmp_path / "step_00000002")
    said: list[str] = []
    intact = manager.latest_intact(said.append)
    assert intact == tmp_path / "step_00000001" and shard.name in said[0]
    fresh = make_engine("qwen2")
    assert fresh.load_checkpoint(intact) == {"step": 1}
    for name, tensor in full_params(fresh).items():
        assert torch.equal(tensor, saved_1[name]), name


# ---------------------------------------------------------------- issue 24, item 2
# A planted payload under every file name a resume opens, with the manifest emptied, cut
# to leave the planted file out, or rewritten to match: never run, always a refusal.

PLANTED = [".metadata", "distcp-value", "trainer.pt", "rng"]
MANIFESTS = ["empty", "partial", "matching"]


def _plant(ckpt: Path, what: str, marker: Path) -> str:
    """Put a ``__reduce__`` payload into the file ``what`` names; return its relative path."""
    if what == ".metadata":
        (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
        return "dcp/.metadata"
    if what == "distcp-value":
        # a real DCP checkpoint whose optimizer lr is the payload: DCP's default planner reads
        # non-tensor values with a full torch.load (weights_only off)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        engine = make_engine("qwen2")
        engine.forward_backward(make_batch(1), token_mean_loss)
        engine.optimizer_step()
        model = engine.handle
        state = {
            "model": get_model_state_dict(model.module),
            "optim": get_optimizer_state_dict(model.module, model.optimizer),
        }
        state["optim"]["param_groups"][0]["lr"] = _Payload(marker)
        shutil.rmtree(ckpt / "dcp")
        dcp.save(state, checkpoint_id=str(ckpt / "dcp"))
        return "dcp/" + next((ckpt / "dcp").glob("*.distcp")).name
    name = "trainer.pt" if what == "trainer.pt" else "rng/rank_0.pt"
    torch.save({"extra": {"step": 1}, "evil": _Payload(marker)}, ckpt / name)
    return name


def _rewrite_manifest(ckpt: Path, how: str, planted: str) -> None:
    if how == "empty":
        (ckpt / MANIFEST).write_text(json.dumps({"version": 1, "files": {}}))
    elif how == "matching":
        write_manifest(ckpt, exclude=frozenset({"COMPLETE"}))
    else:  # partial: every other file as it is, the planted one left out
        write_manifest(ckpt, exclude=frozenset({"COMPLETE"}))
        manifest = json.loads((ckpt / MANIFEST).read_text())
        manifest["files"] = {
            k: v
            for k, v in manifest["files"].items()
            if not (k.startswith("dcp/") if planted.startswith("dcp/") else k == planted)
        }
        (ckpt / MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    engine = make_engine("qwen2")
    root = tmp_path_factory.mktemp("pristine")
    _train_and_save(engine, CheckpointManager(root), 1)
    return root / "step_00000001"


@pytest.mark.parametrize("manifest", MANIFESTS)
@pytest.mark.parametrize("planted", PLANTED)
def test_a_planted_pickle_never_runs_whatever_the_manifest_says(
    saved_checkpoint: Path, tmp_path: Path, planted: str, manifest: str
) -> None:
    ckpt = tmp_path / "step_00000001"
    shutil.copytree(saved_checkpoint, ckpt)
    marker = tmp_path / "pwned"
    name = _plant(ckpt, planted, marker)
    _rewrite_manifest(ckpt, manifest, name)
    engine = make_engine("qwen2")
    with pytest.raises(CheckpointError) as err:
        engine.load_checkpoint(ckpt)
    assert not marker.exists(), "the payload ran"
    message = str(err.value)
    if manifest == "matching":
        assert "refusing to load it" in message and "never unpickles code" in message, message
    else:
        assert "is damaged: " in message and name in message and f"not in {MANIFEST}" in message, message


def test_the_safe_dcp_reader_restores_what_the_default_one_does(saved_checkpoint: Path) -> None:
    # the allow-lists refuse nothing DCP itself writes (model, AdamW state, param groups)
    a, b = make_engine("qwen2"), make_engine("qwen2")
    assert a.load_checkpoint(saved_checkpoint) == {"step": 1}
    import torch.distributed.checkpoint as dcp
    from geartrain_fsdp.checkpoint import _app_state

    state = _app_state(b.handle)
    dcp.load(state, checkpoint_id=str(saved_checkpoint / "dcp"))
    safe = _app_state(a.handle)
    assert safe["optim"]["param_groups"] == state["optim"]["param_groups"]
    for key, tensor in state["model"].items():
        assert torch.equal(
            safe["model"][key].full_tensor() if hasattr(safe["model"][key], "full_tensor") else safe["model"][key],
            tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor,
        ), key


def test_a_dcp_state_missing_an_entry_is_one_line_naming_it(saved_checkpoint: Path, tmp_path: Path) -> None:
    """Probe rerun for issue 35 items 5 and 10: a checkpoint whose ``dcp/`` was rewritten
    with the tensors only (the optimizer's param groups left out) and a manifest to match
    was a 65-line traceback (DCP's CheckpointException), exit 1, from export and --resume."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ckpt = tmp_path / "step_00000001"
    shutil.copytree(saved_checkpoint, ckpt)
    saved = FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata
    tensors = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in saved.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    assert any(key.startswith("optim.param_groups") for key in saved if key not in tensors)
    dcp.load(tensors, checkpoint_id=str(ckpt / "dcp"), no_dist=True)
    shutil.rmtree(ckpt / "dcp")
    dcp.save(tensors, checkpoint_id=str(ckpt / "dcp"), no_dist=True)
    (ckpt / "COMPLETE").unlink()
    write_manifest(ckpt, exclude=frozenset({"COMPLETE"}))
    (ckpt / "COMPLETE").write_text("")
    with pytest.raises(CheckpointError) as err:
        make_engine("qwen2").load_checkpoint(ckpt)
    assert str(err.value).startswith(
        f"{ckpt}: its model and optimizer state (dcp/) does not fit the model this job builds (Missing key in "
        "checkpoint state_dict: optim.param_groups.0."
    ), str(err.value)
    assert "\n" not in str(err.value)
