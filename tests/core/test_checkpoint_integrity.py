"""A checkpoint never runs code when loaded, and a damaged one is named and passed over.

Issue 10, items 2 and 3: ``trainer.pt`` with a malicious ``__reduce__`` ran on resume, and
4 KB overwritten inside a shard resumed silently.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch
from geartrain import CheckpointError, CheckpointManager, load_state, save_state
from geartrain.checkpoint import MARKER
from geartrain.manifest import MANIFEST, verify_manifest, write_manifest

ROOT = Path(__file__).resolve().parents[2]


class _Payload:
    """Unpickling this creates ``marker``: the stand-in for arbitrary code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (open, (str(self.marker), "w"))


def test_load_state_never_runs_code_from_the_file(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    torch.save({"scheduler": None, "extra": {"step": 3, "evil": _Payload(marker)}}, tmp_path / "trainer.pt")
    with pytest.raises(CheckpointError, match=r"trainer\.pt: refusing to load it") as err:
        load_state(tmp_path / "trainer.pt")
    assert "never unpickles code" in str(err.value)
    assert not marker.exists(), "the payload ran"


def test_load_state_round_trips_what_the_trainer_saves(tmp_path: Path) -> None:
    import numpy as np

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "extra": {
            "step": 4,
            "loader": {"epoch": 0, "index": 64, "seed": 0, "shuffle": True, "num_prompts": 100},
            "accuracy_before": 0.25,
            "kl_coef": None,
            "python_random": random.getstate(),
        },
        "rng": torch.get_rng_state(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "scheduler": {"base_lrs": [3e-4], "last_epoch": 4, "lr_lambdas": [None]},
    }
    save_state(state, tmp_path / "s.pt")
    back = load_state(tmp_path / "s.pt")
    assert back["extra"] == state["extra"]
    assert torch.equal(back["rng"], state["rng"]) and torch.equal(back["numpy"][1], state["numpy"][1])
    random.setstate(back["extra"]["python_random"])


_LOAD = re.compile(r"torch\.load\(([^)]*)\)")


def test_nothing_geartrain_ships_loads_a_checkpoint_with_weights_only_false() -> None:
    """Every ``torch.load`` in the core, the plugins, the third-party example plugin and
    the docs reads with ``weights_only=True`` (or goes through ``geartrain.load_state``)."""
    roots = [ROOT / "core", ROOT / "plugins", ROOT / "tests" / "third_party_plugin", ROOT / "docs", ROOT / "README.md"]
    offenders = []
    for root in roots:
        files = [root] if root.is_file() else [*root.rglob("*.py"), *root.rglob("*.md")]
        for file in files:
            for match in _LOAD.finditer(file.read_text(encoding="utf-8")):
                if "weights_only=True" not in match.group(1):
                    offenders.append(f"{file.relative_to(ROOT)}: {match.group(0)}")
    assert not offenders, "checkpoint files read without weights_only=True:\n" + "\n".join(offenders)


# ----------------------------------------------------------------------------- manifests


def _writer(step: int, size: int = 64 * 1024):  # noqa: ANN202
    def write(d: Path) -> None:
        (d / "dcp").mkdir()
        (d / "dcp" / "__0_0.distcp").write_bytes(bytes((step * 7 + i) % 251 for i in range(size)))
        (d / "trainer.pt").write_bytes(b"trainer state %d" % step)

    return write


def _overwrite(path: Path, offset: int, n: int = 4096) -> None:
    with path.open("r+b") as fh:
        fh.seek(offset)
        fh.write(b"\xff" * n)


def test_every_checkpoint_has_a_manifest_written_before_its_marker(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    path = mgr.save(1, _writer(1))
    manifest = (path / MANIFEST).read_text()
    assert "dcp/__0_0.distcp" in manifest and "trainer.pt" in manifest and "COMPLETE" not in manifest
    assert verify_manifest(path) == []
    assert CheckpointManager.check_complete(path) == path


def test_overwritten_bytes_inside_a_shard_fall_back_to_the_intact_checkpoint(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=3)
    for step in (1, 2):
        mgr.save(step, _writer(step))
    newest = tmp_path / "step_00000002"
    _overwrite(newest / "dcp" / "__0_0.distcp", offset=20_000)  # same size, other bytes
    said: list[str] = []
    assert mgr.latest_intact(said.append) == tmp_path / "step_00000001"
    assert len(said) == 1
    assert str(newest) in said[0] and "dcp/__0_0.distcp" in said[0] and "SHA-256" in said[0]
    assert "falling back to the previous checkpoint" in said[0]
    with pytest.raises(CheckpointError, match=r"step_00000002 is damaged: dcp/__0_0\.distcp"):
        CheckpointManager.check_complete(newest)


def test_a_truncated_or_missing_file_is_named(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=3)
    for step in (1, 2, 3):
        mgr.save(step, _writer(step))
    shard = tmp_path / "step_00000003" / "dcp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    (tmp_path / "step_00000002" / "trainer.pt").unlink()
    said: list[str] = []
    assert mgr.latest_intact(said.append) == tmp_path / "step_00000001"
    assert "dcp/__0_0.distcp has 1000 bytes, the manifest says 65536" in said[0]
    assert "trainer.pt is missing" in said[1]


def test_no_intact_checkpoint_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _writer(1))
    (tmp_path / "step_00000001" / MANIFEST).unlink()
    said: list[str] = []
    with pytest.raises(CheckpointError, match="every checkpoint under .* is damaged"):
        mgr.latest_intact(said.append)
    assert "MANIFEST.json is missing" in said[0] and "no older checkpoint is left" in said[0]


def test_the_manifest_can_also_require_another_role_intact(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=3)
    for step in (1, 2):
        mgr.save(step, _writer(step))
    said: list[str] = []
    latest = mgr.latest_intact(said.append, also=lambda p: ["its critic is damaged"] if p.name.endswith("2") else [])
    assert latest == tmp_path / "step_00000001" and "its critic is damaged" in said[0]


def test_write_manifest_skips_what_it_is_told(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("x")
    (tmp_path / "COMPLETE").write_text("{}")
    write_manifest(tmp_path, exclude=frozenset({"COMPLETE"}))
    (tmp_path / "COMPLETE").write_text('{"changed": 1}')
    assert verify_manifest(tmp_path) == []
    (tmp_path / "a").write_text("y")
    assert verify_manifest(tmp_path) == ["a does not match its SHA-256 in the manifest (its content was changed)"]


def test_a_checkpoint_renamed_to_another_step_is_passed_over_naming_both_steps(tmp_path: Path) -> None:
    """Probe rerun for issue 35 item 5: the newest checkpoint's directory renamed from
    step_2 to step_9 was taken by its name; a --resume went on from it as newest, and after
    a later save at step 3 the next --resume went back to it (step 2), dropping step 3. The
    step the engine recorded (engine.json, in the manifest) must be the directory's."""
    import json

    mgr = CheckpointManager(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        mgr.save(step, lambda d, s=step: (d / "engine.json").write_text(json.dumps({"step": s})))
    (tmp_path / "step_00000003").rename(tmp_path / "step_00000009")
    said: list[str] = []
    assert mgr.latest_intact(said.append) == tmp_path / "step_00000002"
    assert said == [
        f"checkpoint {tmp_path / 'step_00000009'} is damaged: engine.json records step 3, not 9: the directory was "
        "renamed or copied over; falling back to the previous checkpoint"
    ]
    with pytest.raises(CheckpointError, match="engine.json records step 3, not 9"):
        CheckpointManager.check_complete(tmp_path / "step_00000009")
    mgr.save(4, lambda d: (d / "state.bin").write_bytes(b"x"))  # no record (another writer): passes
    assert CheckpointManager.check_complete(tmp_path / "step_00000004") == tmp_path / "step_00000004"


def test_a_newer_step_without_its_marker_is_said_when_passed_over(tmp_path: Path) -> None:
    """Probe rerun for issue 35 item 5 (probes3): the newest checkpoint with its COMPLETE
    marker removed was passed over in silence by ``export`` (which exported the step before)
    and ``--resume`` (which resumed from it and later deleted the unmarked directory)."""
    mgr = CheckpointManager(tmp_path, keep_last=3)
    for step in (1, 2):
        mgr.save(step, _writer(step))
    (tmp_path / "step_00000002" / MARKER).unlink()
    said: list[str] = []
    assert mgr.latest_intact(said.append) == tmp_path / "step_00000001"
    assert said == [
        f"checkpoint {tmp_path / 'step_00000002'} is damaged: it has no COMPLETE marker (cut off mid-write, or "
        "the marker was removed); falling back to the newest complete one"
    ]
    (tmp_path / "step_00000001" / MARKER).unlink()
    said.clear()
    assert mgr.latest_intact(said.append) is None
    assert [line.rsplit("; ", 1)[1] for line in said] == ["no complete checkpoint is left"] * 2
    assert [Path(line.split()[1]).name for line in said] == ["step_00000002", "step_00000001"]
