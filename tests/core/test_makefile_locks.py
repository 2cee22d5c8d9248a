"""`make train` never uses a .venv that `make test` is rebuilding (issue 19, item 15): the
environments are built under an exclusive lock on .venv.lock, a train takes the same lock
to build what it needs and runs under a shared one. Read from `make -n` with ``echo``
standing in for flock, so nothing runs and no lock is waited for."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

#: a hang guard only, for a child process (a Python start-up importing torch, a make run):
#: far above what it takes on a loaded machine, so it never decides a test
HANG_GUARD_S = 600

ROOT = Path(__file__).resolve().parents[2]
LOCK = f"{ROOT}/.venv.lock"


def _dry(target: str) -> list[str]:
    if shutil.which("make") is None:
        pytest.fail("this test needs make")
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", target, "FLOCK=echo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_train_builds_under_the_exclusive_lock_and_trains_under_a_shared_one() -> None:
    lines = _dry("train")
    assert lines[0] == f"echo {LOCK} make --no-print-directory .venv/.base"
    train = [line for line in lines if "geartrain train" in line]
    assert train and all(line.startswith(f"echo -s {LOCK} .venv/bin/geartrain train") for line in train)


def test_make_test_builds_the_environments_under_the_exclusive_lock() -> None:
    assert _dry("envs")[0].startswith(f"echo {LOCK} make -j3 ")


def test_finished_environments_share_identical_files_and_unfinished_ones_are_left_alone(tmp_path: Path) -> None:
    """The environments' identical files become hard links (a CI run ran out of disk building 7
    copies of torch), but only in environments whose final marker exists: one still being built
    may have a pip writing it."""
    if shutil.which("hardlink") is None:
        pytest.skip("util-linux hardlink is not installed: the Makefile skips linking too")
    payload = bytes(range(256)) * 256  # 64 KiB, above the 16K minimum size
    for env, marker in ((".venvs/a", ".ok"), (".venv", ".full"), (".venvs/building", None)):
        lib = tmp_path / env / "lib"
        lib.mkdir(parents=True)
        (lib / "torch.so").write_bytes(payload)
        (lib / "small.py").write_bytes(payload[:100])
        if marker:
            (tmp_path / env / marker).touch()
    out = subprocess.run(
        ["make", "-f", str(ROOT / "Makefile"), "--no-print-directory", "link-envs"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert out.returncode == 0, out.stderr
    inode = {
        env: (tmp_path / env / "lib" / "torch.so").stat().st_ino for env in (".venvs/a", ".venv", ".venvs/building")
    }
    assert inode[".venvs/a"] == inode[".venv"]
    assert inode[".venvs/building"] != inode[".venv"]
    assert (tmp_path / ".venvs/a/lib/small.py").stat().st_nlink == 1
    assert (tmp_path / ".venv/lib/torch.so").read_bytes() == payload
