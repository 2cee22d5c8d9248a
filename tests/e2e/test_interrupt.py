"""Ctrl-C (issue 19, item 10): one line naming the step and the last complete checkpoint,
exit status 130, no traceback; the same when the interrupt lands inside a save."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_helpers import JOB_HANG_GUARD_S, MAIN_CONFIG, ROOT, geartrain_cmd, rl_records
from geartrain import CheckpointManager
from geartrain.trainer.run import train_from_cli

FAST = [
    "sft.enabled=false",
    "trainer.progress=false",
    "trainer.tensorboard=false",
    "trainer.export_hf=false",
    "trainer.plot=false",
    "validation.every_n_steps=0",
    "validation.max_prompts=8",
    "trainer.save_every=2",
]
LINE = re.compile(r"^interrupted at step (\d+); the last complete checkpoint is step (\d+); continue with --resume$")


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # a terminal's foreground job gets SIGINT with the default disposition (a background
    # shell job would have it ignored)
    proc = subprocess.Popen(
        geartrain_cmd("train", str(MAIN_CONFIG), *FAST, "trainer.total_steps=1000", f"trainer.output_dir={out}"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + JOB_HANG_GUARD_S  # a hang guard: step 4 ends the wait
        while not (out / "metrics.jsonl").exists() or len(rl_records(out / "metrics.jsonl")) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=JOB_HANG_GUARD_S)  # a hang guard: the Ctrl-C ends it
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = [line for line in err.splitlines() if line.strip()][-1]
    match = LINE.match(last)
    assert match, last
    step, ckpt = int(match[1]), int(match[2])
    assert step >= 4 and ckpt % 2 == 0 and ckpt in (step - 1, step - 2, step)
    complete = [CheckpointManager.step_of(p) for p in CheckpointManager(out / "checkpoints" / "actor").complete()]
    assert max(complete) == ckpt  # the checkpoint named is the newest complete one on disk


def test_ctrl_c_inside_a_save_names_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import geartrain.checkpoint as checkpoint

    real = checkpoint.write_manifest

    def interrupted_in_step_4(path: Path, **kwargs):  # noqa: ANN003, ANN202
        if path.name.endswith("step_00000004"):  # the shards are written, the manifest not yet
            raise KeyboardInterrupt
        return real(path, **kwargs)

    monkeypatch.setattr(checkpoint, "write_manifest", interrupted_in_step_4)
    err = _interrupted_at_step_4(tmp_path, capsys)
    assert "Traceback" not in err


def test_ctrl_c_inside_dcp_s_own_write_is_still_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """DCP catches everything a rank's write raises, KeyboardInterrupt included, and raises
    its own CheckpointException: a Ctrl-C that lands while the shards are written must still
    end the job with the one line and 130 (it once printed DCP's traceback and exited 1)."""
    from torch.distributed.checkpoint import FileSystemWriter

    real = FileSystemWriter.write_data

    def interrupted_in_step_4(self, plan, planner):  # noqa: ANN001, ANN202
        if "step_00000004" in str(self.path):
            raise KeyboardInterrupt
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", interrupted_in_step_4)
    err = _interrupted_at_step_4(tmp_path, capsys)
    assert "Traceback" not in err


@pytest.fixture(autouse=True)
def logging_restored() -> Iterator[None]:
    """An interrupted ``train_from_cli`` silences logging for the rest of its process (nothing
    may follow its one line); these tests run it in the test process, so logging is turned
    back on after each (later tests read their warnings through caplog)."""
    yield
    logging.disable(logging.NOTSET)


@pytest.fixture
def terminal_sigint() -> Iterator[None]:
    """SIGINT as a terminal's foreground job has it: Python's own handler. A test run started
    in the background (``cmd &`` in a script, CI runners) inherits SIGINT *ignored*, so
    Python installs no handler and a raised SIGINT does nothing (the job is then right to
    leave it alone: nothing can interrupt it)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_swallowed_by_a_checkpoint_writer_is_still_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], terminal_sigint: None
) -> None:
    """torch.save's C++ zip writer can drop the KeyboardInterrupt raised in its Python write
    callback and fail later with "unexpected pos" (seen in a CI run): SIGINT arrived, so the
    job still ends as interrupted."""
    from torch.distributed.checkpoint import FileSystemWriter

    real = FileSystemWriter.write_data

    def swallowed_in_step_4(self, plan, planner):  # noqa: ANN001, ANN202
        if "step_00000004" not in str(self.path):
            return real(self, plan, planner)
        try:
            signal.raise_signal(signal.SIGINT)  # to this thread: the handler runs before it returns
            time.sleep(1.0)  # not reached: the handler raised
        except KeyboardInterrupt:
            pass  # what the C++ writer does with it
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 367 vs 337")

    monkeypatch.setattr(FileSystemWriter, "write_data", swallowed_in_step_4)
    _interrupted_at_step_4(tmp_path, capsys)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the watch is gone after the job


def _interrupted_at_step_4(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Run 6 steps of the main job in this process (the caller makes step 4's save see
    Ctrl-C); assert it ends with 130 and the one line naming checkpoint 2, the newest
    complete one on disk. Returns what it printed on stderr."""
    out = tmp_path / "run"
    rc = train_from_cli(str(MAIN_CONFIG), [*FAST, "trainer.total_steps=6", f"trainer.output_dir={out}"])
    err = capsys.readouterr().err
    assert rc == 130, err[-3000:]
    assert [line for line in err.splitlines() if line.strip()][-1] == (
        "interrupted at step 4; the last complete checkpoint is step 2; continue with --resume"
    )
    assert max(CheckpointManager.step_of(p) for p in CheckpointManager(out / "checkpoints" / "actor").complete()) == 2
    return err


def test_sigterm_stops_like_ctrl_c_and_puts_back_the_run_overwrite_set_aside(tmp_path: Path) -> None:
    """Probes rerun (issue 35): SIGTERM (a timeout, a scheduler's preemption, ``docker
    stop``) right after ``--overwrite`` set the previous run aside killed the job outright,
    leaving the previous run in .geartrain-overwritten. Now it takes Ctrl-C's path: the
    previous run is put back, one line, exit 143."""
    from geartrain.testing.runs import file_tree, write_finished_run
    from geartrain.trainer import load_train_config

    out = tmp_path / "run"
    before = write_finished_run(load_train_config(MAIN_CONFIG, [f"trainer.output_dir={out}"]), 4)
    # the SFT warm start (hundreds of steps) lies between the claim and the first RL step
    proc = subprocess.Popen(
        geartrain_cmd("train", str(MAIN_CONFIG), "trainer.progress=false", f"trainer.output_dir={out}", "--overwrite"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # ends at the job's end: a hang guard is communicate's below
            if "set aside in" in line:
                break
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=JOB_HANG_GUARD_S)  # a hang guard: SIGTERM ends it
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith("terminated by SIGTERM at step 0; no checkpoint was completed"), last
    after = {name: digest for name, digest in file_tree(out).items() if not name.startswith(("logs/", ".geartrain"))}
    assert after == before and not (out / ".geartrain-overwritten").exists(), sorted(after)
