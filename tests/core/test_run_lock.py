"""A live run owns its output directory (issue 24, item 1): a fresh run, ``--resume`` and
``--overwrite`` into it are refused in one line naming the live run, and change nothing;
the lock of a run whose process is gone is taken over, saying whose it was.

The live run is a real second process holding the lock; the jobs refused run the real
:func:`geartrain.trainer.run_job` (the lock is checked before any engine is built)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from geartrain.trainer import run_job
from geartrain.trainer.rundir import RunDirectory
from geartrain.trainer.runlock import LOCK_NAME, RunLock, RunLockedError
from test_run_safety import _config, _finished_run, _tree

HOLD = (
    "import sys, time\n"
    "from geartrain.trainer.runlock import RunLock\n"
    "lock = RunLock.acquire(sys.argv[1])\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


def _live_run(out: Path) -> subprocess.Popen[str]:
    """A process that holds ``out``'s lock, as a training job does for its whole life."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture
def live(tmp_path: Path):  # noqa: ANN201
    out = tmp_path / "run"
    _finished_run(out)
    proc = _live_run(out)
    yield out, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("mode", ["fresh", "resume", "overwrite"])
def test_a_live_runs_directory_is_refused_in_every_mode(live, mode: str) -> None:  # noqa: ANN001
    out, proc = live
    before = _tree(out)
    with pytest.raises(RunLockedError) as err:
        run_job(_config(out), resume=mode == "resume", overwrite=mode == "overwrite")
    message = str(err.value)
    assert "\n" not in message
    assert f"'{out}' is in use by a live run" in message
    assert f"pid {proc.pid} on host {socket.gethostname()}" in message and "nothing was changed" in message
    assert _tree(out) == before, "a refused job changed the live run's directory"


def test_a_stale_lock_is_taken_over_and_named(live) -> None:  # noqa: ANN001
    out, proc = live
    proc.send_signal(signal.SIGKILL)  # the run dies without releasing anything
    proc.wait()
    rundir = RunDirectory(out, overwrite=True)
    removed = rundir.claim()
    try:
        assert "checkpoints" in removed
        assert rundir.lock is not None and rundir.lock.previous is not None
        assert rundir.lock.previous.pid == proc.pid
        note = rundir.lock.stale_note()
        assert note is not None and f"pid {proc.pid}" in note and "a run that is gone" in note
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()} on host"):  # now this job holds it
            RunDirectory(out, resume=True).check()
    finally:
        rundir.release()
    assert (out / LOCK_NAME).read_text() == "", "a clean release leaves no owner behind"
    again = RunLock.acquire(out)  # ... so the next job takes it over without a note
    try:
        assert again.previous is None and again.stale_note() is None
    finally:
        again.release()


def test_a_job_releases_its_lock_when_it_fails(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # passes every check and claims the directory, then fails building its first engine
    # (this environment has no engine plugin): the lock must not outlive the job
    with pytest.raises(Exception):  # noqa: B017, PT011 - whichever error the missing backend raises
        run_job(_config(out))
    assert (out / LOCK_NAME).exists()
    RunLock.acquire(out).release()


@pytest.mark.parametrize("target", ["hf", "exports/step4", "."])
def test_an_export_into_a_live_runs_directory_is_refused(live, target: str) -> None:  # noqa: ANN001
    """Probe of issue 35 (probes6): ``geartrain export RUN RUN/hf`` was accepted while the
    run trained, and the run's own export at its end writes the same directory. Exporting
    a live run's newest checkpoint elsewhere is a use, and stays allowed."""
    from geartrain.trainer.export import ExportError, check_target

    out, proc = live
    checkpoint = out / "checkpoints" / "actor" / "step_00000004"
    with pytest.raises(ExportError) as err:
        check_target(out / target, out, checkpoint, overwrite=False)
    message = str(err.value)
    assert f"is inside {out}, the directory of a run still training (pid {proc.pid} on host" in message, message
    elsewhere = out.parent / "elsewhere"
    assert check_target(elsewhere, out, checkpoint, overwrite=False) == []
    proc.kill()
    proc.wait()
    assert check_target(out / "hf", out, checkpoint, overwrite=False) == []  # the run has ended
