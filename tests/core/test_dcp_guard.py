"""The core's check of DCP pickles (:func:`geartrain.dcp_guard.check_dcp_pickles`, run by
``Engine.load_checkpoint`` before any backend): megatron's ``dist_checkpointing`` layout
(``dist/.metadata``, ``dist/common.pt``, DCP shards) with a planted ``__reduce__`` in each
is refused without running it, and a real DCP checkpoint passes (issue 24 item 2; the FSDP
engine's resume is tested in tests/fsdp_engine/test_checkpoint_safety.py)."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from geartrain import CheckpointError
from geartrain.dcp_guard import check_dcp_pickles, read_dcp_metadata


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (open, (str(self.marker), "w"))


def _save(ckpt: Path, lr: object = 3e-4) -> None:
    state = {
        "model": {"w": torch.arange(6.0).reshape(2, 3)},
        "optim": {"param_groups": [{"lr": lr, "betas": (0.9, 0.99)}]},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        dcp.save(state, checkpoint_id=str(ckpt / "dist"))
    torch.save({"steps": 3, "content": {"layers": 2}}, ckpt / "dist" / "common.pt")


def test_a_real_dcp_checkpoint_passes(tmp_path: Path) -> None:
    _save(tmp_path)
    check_dcp_pickles(tmp_path)
    assert "model.w" in read_dcp_metadata(tmp_path / "dist" / ".metadata").state_dict_metadata


@pytest.mark.parametrize("planted", [".metadata", "common.pt", "value"])
def test_a_planted_payload_is_refused_and_never_runs(tmp_path: Path, planted: str) -> None:
    marker = tmp_path / "pwned"
    _save(tmp_path, lr=_Payload(marker) if planted == "value" else 3e-4)
    if planted == ".metadata":
        (tmp_path / "dist" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    elif planted == "common.pt":
        torch.save({"steps": 3, "evil": _Payload(marker)}, tmp_path / "dist" / "common.pt")
    with pytest.raises(CheckpointError) as err:
        check_dcp_pickles(tmp_path)
    assert not marker.exists(), "the payload ran"
    message = str(err.value)
    assert "refusing to load it" in message and "never unpickles code" in message
    expected = {
        ".metadata": "dist/.metadata",
        "common.pt": "dist/common.pt",
        "value": "(value 'optim.param_groups.0.lr')",
    }
    assert expected[planted] in message, message
