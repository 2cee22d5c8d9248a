"""A save that runs out of disk space says so in one line, naming the device, the step
being saved and the last complete checkpoint, and touches no older checkpoint (issue 24,
item 5). The disk is a small tmpfs where this process may mount one (root in a container
that allows it), and an injected ``OSError(ENOSPC)`` everywhere."""

from __future__ import annotations

import errno
import hashlib
import os
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
        f"{tmp_path / 'ckpt'}. Free space there, then start again with --overwrite"
    )  # probe rerun for issue 35 item 6: it said "continue with --resume", which after an --overwrite that put
    # the previous run back would continue that run (and with no checkpoint there is nothing to continue)
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_other_write_errors_are_not_called_a_full_disk(tmp_path: Path) -> None:
    def denied(d: Path) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(d))

    with pytest.raises(PermissionError):
        CheckpointManager(tmp_path / "ckpt").save(0, denied)


# ----------------------------------------------------------------------------- issue 35, item 6


def _dcp_writer(mib: int):  # noqa: ANN202
    """A save through torch.distributed.checkpoint, which wraps a rank's write error in its
    CheckpointException, a BaseException."""
    import torch.distributed.checkpoint as dcp

    return lambda d: dcp.save({"w": torch.ones(mib << 18)}, checkpoint_id=str(d / "model"), no_dist=True)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_full_disk_under_dcp_is_one_line_and_the_partial_save_goes(small_disk: Path) -> None:
    mgr = CheckpointManager(small_disk / "ckpt", keep_last=2)
    mgr.save(1, _dcp_writer(1))
    before = _tree(small_disk / "ckpt")
    with pytest.raises(DiskFullError) as err:
        mgr.save(2, _dcp_writer(8))
    assert str(err.value).startswith(f"no space left on tmpfs (mounted at {small_disk}) while saving step 2; ")
    assert _tree(small_disk / "ckpt") == before
    assert sorted(p.name for p in (small_disk / "ckpt").iterdir()) == ["step_00000001"]  # no .partial-step_2


def _checkpoint_exception(inner: BaseException) -> BaseException:
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException("write", {0: (inner, traceback.StackSummary())})


def test_an_injected_dcp_enospc_is_one_line(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "ckpt")

    def full(d: Path) -> None:
        (d / "half").write_bytes(b"x" * 100)
        raise _checkpoint_exception(OSError(errno.ENOSPC, "No space left on device", str(d / "x.distcp")))

    with pytest.raises(DiskFullError, match="while saving step 0; no checkpoint was completed"):
        mgr.save(0, full)
    assert list((tmp_path / "ckpt").iterdir()) == []


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit], ids=["ctrl-c", "exit"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["raw", "dcp-wrapped"])
def test_ctrl_c_or_exit_during_a_save_on_a_full_disk_goes_on_as_it_is(tmp_path: Path, stop, wrapped: bool) -> None:  # noqa: ANN001
    def interrupted(d: Path) -> None:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", str(d))
        except OSError:
            raise (_checkpoint_exception(stop()) if wrapped else stop()) from None

    with pytest.raises(BaseException) as err:
        CheckpointManager(tmp_path / "ckpt").save(0, interrupted)
    assert not isinstance(err.value, DiskFullError)
    assert isinstance(err.value, stop) or type(err.value).__name__ == "CheckpointException"


def test_a_full_disk_during_the_hf_export_is_one_line_and_removes_the_partial_export(small_disk: Path) -> None:
    from geartrain.checkpoint import export_disk_full
    from geartrain.export import write_safetensors

    out = small_disk / "hf"
    with pytest.raises(BaseException) as err:  # safetensors' own error: "No space left on device (os error 28)"
        write_safetensors(out, [("w", torch.ones(8 << 18))])
    full = export_disk_full(err.value, out, "run")
    assert full is not None and str(full) == (
        f"no space left on tmpfs (mounted at {small_disk}) while exporting the model to {out} (the partial export "
        f"was removed; the checkpoints are untouched); free space there, then: geartrain export run {out}"
    )
    assert not out.exists()
    assert export_disk_full(PermissionError(errno.EACCES, "denied"), small_disk / "x", "run") is None


def test_a_write_error_with_its_own_cause_or_a_pseudo_file_system_is_not_a_full_disk() -> None:
    """Probe rerun for issue 35 items 6 and 11: ``geartrain export RUN /proc/x`` said "no
    space left on proc" (its mkdir failed with ENOENT, and /proc, which has no blocks,
    looked full); the export now says the write's own cause."""
    from geartrain.checkpoint import disk_is_full

    assert os.statvfs("/proc").f_blocks == 0
    assert not disk_is_full(OSError(errno.ENOENT, "No such file or directory", "/proc/x"), "/proc")
    assert not disk_is_full(RuntimeError("a writer that lost the errno"), "/proc")
    assert disk_is_full(OSError(errno.ENOSPC, "No space left on device"), "/proc")


@pytest.fixture
def file_size_limit():  # noqa: ANN201
    """This process's file size limit (``ulimit -f``) at 1 MiB for the test, then back."""
    import resource
    import signal

    assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN  # Python's default: a write fails with EFBIG
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    yield 1 << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@pytest.mark.parametrize("writer", [_file_writer, _torch_writer], ids=["os-write", "torch-save"])
def test_a_file_size_limit_is_one_line_naming_it(tmp_path: Path, file_size_limit: int, writer) -> None:  # noqa: ANN001
    """Probe rerun for issue 35 item 6 (probes3): under ``ulimit -f 2000`` a run's first
    checkpoint was a 91-line traceback (torch's zip writer: 'unexpected pos'), exit 1, with
    ``.partial-step_00000000`` left: the disk had space, so it was not taken for a full one."""
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    mgr.save(1, lambda d: (d / "small.bin").write_bytes(b"\x01" * 1000))
    before = _tree(tmp_path / "ckpt")
    with pytest.raises(DiskFullError) as info:
        mgr.save(2, writer(2))
    assert str(info.value) == (
        f"no space left on {device_of(tmp_path / 'ckpt')} (or this process's file size limit, ulimit -f, "
        f"of {file_size_limit} bytes reached) while saving step 2; the last complete checkpoint is step 1 "
        f"({tmp_path / 'ckpt' / 'step_00000001'}). Free space there (or lower trainer.keep_last), then continue "
        "with --resume"
    )
    assert _tree(tmp_path / "ckpt") == before  # the partial save is gone, step 1 untouched


def test_a_file_size_limit_under_the_hf_export_is_one_line(tmp_path: Path, file_size_limit: int) -> None:
    """Probe rerun for issue 35 item 6 (probes3): ``geartrain export`` under ``ulimit -f 600``
    was a 43-line traceback (safetensors' own error, 'File too large (os error 27)', carries no
    errno) and left the partial export."""
    from geartrain.checkpoint import export_disk_full
    from geartrain.export import write_safetensors

    out = tmp_path / "hf"
    out.mkdir()
    with pytest.raises(Exception) as info:
        write_safetensors(out, [("w", torch.ones(1 << 19))])  # 2 MiB
    error = export_disk_full(info.value, out, "run")
    assert error is not None and str(error).startswith(
        f"no space left on {device_of(tmp_path)} (or this process's file size limit, ulimit -f, of "
        f"{file_size_limit} bytes reached) while exporting the model to {out} (the partial export was removed"
    )
    assert not out.exists()
