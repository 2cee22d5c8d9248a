"""A save that runs out of disk space says so in one line, naming the device, the step
being saved and the last complete checkpoint, and touches no older checkpoint (issue 24,
item 5). The disk is a small tmpfs where this process may mount one (root in a container
that allows it), and an injected ``OSError(ENOSPC)`` everywhere."""

from __future__ import annotations

import errno
import hashlib
import subprocess
from pathlib import Path

import pytest
import torch
from geartrain import CheckpointManager
from geartrain.checkpoint import DiskFullError, device_of


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def small_disk(tmp_path: Path):  # noqa: ANN201
    """A 4 MiB tmpfs, or skip where mounting is not allowed (the injected test still runs)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); the injected ENOSPC test covers the message")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _file_writer(mib: int):  # noqa: ANN202
    def write(d: Path) -> None:
        with open(d / "state.bin", "wb") as fh:
            for _ in range(mib):
                fh.write(b"\x01" * (1 << 20))

    return write


def _torch_writer(mib: int):  # noqa: ANN202
    # torch.save's zip writer loses the errno: "unexpected pos ... vs ..." (the 92 lines)
    return lambda d: torch.save({"w": torch.ones(mib << 18)}, d / "trainer.pt")


@pytest.mark.parametrize("writer", [_file_writer, _torch_writer], ids=["os-write", "torch-save"])
def test_a_full_tmpfs_is_one_line_and_older_checkpoints_stay(small_disk: Path, writer) -> None:  # noqa: ANN001
    mgr = CheckpointManager(small_disk / "ckpt", keep_last=2)
    mgr.save(1, writer(1))
    before = _tree(small_disk / "ckpt")
    with pytest.raises(DiskFullError) as err:
        mgr.save(2, writer(8))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(
        f"no space left on tmpfs (mounted at {small_disk}) while saving step 2; "
        f"the last complete checkpoint is step 1 ({small_disk / 'ckpt' / 'step_00000001'})"
    ), message
    assert _tree(small_disk / "ckpt") == before, "an older checkpoint was touched (or the partial save left behind)"
    assert mgr.latest_intact(lambda _: None) == small_disk / "ckpt" / "step_00000001"
    mgr.save(3, writer(1))  # the space of the failed save was given back
    assert [p.name for p in mgr.complete()] == ["step_00000001", "step_00000003"]


def test_an_injected_enospc_is_one_line(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "ckpt")

    def full(d: Path) -> None:
        (d / "half").write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device", str(d / "trainer.pt"))

    with pytest.raises(DiskFullError) as err:
        mgr.save(0, full)
    assert str(err.value) == (
        f"no space left on {device_of(tmp_path)} while saving step 0; no checkpoint was completed in "
        f"{tmp_path / 'ckpt'}. Free space there (or lower trainer.keep_last), then continue with --resume"
    )
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_other_write_errors_are_not_called_a_full_disk(tmp_path: Path) -> None:
    def denied(d: Path) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(d))

    with pytest.raises(PermissionError):
        CheckpointManager(tmp_path / "ckpt").save(0, denied)
