"""Atomic checkpoints: a save killed at any point leaves the previous one loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from geartrain.checkpoint import MARKER, CheckpointManager
from geartrain.errors import CheckpointError


def write_file(name: str, text: str):  # noqa: ANN201
    return lambda d: (d / name).write_text(text)


def test_latest_is_the_newest_complete_and_retention_keeps_k(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        mgr.save(step, write_file("w.txt", f"step {step}"))
    assert [CheckpointManager.step_of(p) for p in mgr.complete()] == [2, 3]
    assert (mgr.latest() / "w.txt").read_text() == "step 3"


def test_a_directory_without_marker_is_never_latest(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, write_file("w.txt", "ok"))
    (tmp_path / "step_00000005").mkdir()  # e.g. copied by hand, cut off
    assert CheckpointManager.step_of(mgr.latest()) == 1
    with pytest.raises(CheckpointError, match="cut off mid-write"):
        CheckpointManager.check_complete(tmp_path / "step_00000005")


def test_a_failing_writer_publishes_nothing(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, write_file("w.txt", "ok"))

    def broken(d: Path) -> None:
        (d / "half").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError):
        mgr.save(2, broken)
    assert CheckpointManager.step_of(mgr.latest()) == 1
    mgr.save(3, write_file("w.txt", "ok"))  # a stale partial does not block the next save
    assert CheckpointManager.step_of(mgr.latest()) == 3
    assert not list(tmp_path.glob(".partial-*"))


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import time, sys
        from pathlib import Path
        from geartrain.checkpoint import CheckpointManager
        mgr = CheckpointManager({str(tmp_path)!r})
        mgr.save(1, lambda d: (d / "w.txt").write_text("one"))
        def slow(d):
            (d / "w.txt").write_text("two, partial")
            print("writing", flush=True)
            time.sleep(3600)  # until the test kills it: no clock decides when
        mgr.save(2, slow)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    mgr = CheckpointManager(tmp_path)
    latest = mgr.latest()
    assert CheckpointManager.step_of(latest) == 1
    assert (latest / "w.txt").read_text() == "one"
    assert (latest / MARKER).exists()
    assert list(tmp_path.glob(".partial-*")), "the killed save's partial directory is left for the next save to clear"
