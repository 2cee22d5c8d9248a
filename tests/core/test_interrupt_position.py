"""What an interrupted job names (issue 35's probes, rerun): the newest checkpoint complete
on disk, also when the interrupt landed between a save's completion and the line that
records it (seen in test_interrupt.py under load: the message named step 8, step 10 was
complete); and SIGTERM takes Ctrl-C's path (exit 143, its own words)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from geartrain import CheckpointManager
from geartrain.trainer import load_train_config
from geartrain.trainer.interrupt import InterruptWatch, RunPosition, interrupted_message
from geartrain.trainer.run import Job

MAIN_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "arithmetic" / "grpo.toml"


def _job(out: Path) -> Job:
    return Job(load_train_config(MAIN_CONFIG, [f"trainer.output_dir={out}"], check_plugins=False))


def test_an_interrupted_job_names_the_newest_checkpoint_complete_on_disk(tmp_path: Path) -> None:
    job = _job(tmp_path / "run")
    job.rundir.claim()
    manager = CheckpointManager(tmp_path / "run" / "checkpoints" / "actor", keep_last=2)
    for step in (2, 4):
        manager.save(step, lambda d: (d / "state.bin").write_bytes(b"x"))
    job.position.step, job.position.checkpoint = 5, 2  # the save of step 4 returned, unrecorded
    job.settle_position()
    job.rundir.release()
    assert job.position.checkpoint == 4
    assert interrupted_message(job.position).endswith("the last complete checkpoint is step 4; continue with --resume")


def test_a_job_stopped_before_it_took_its_directory_names_no_checkpoint_there(tmp_path: Path) -> None:
    out = tmp_path / "run"
    CheckpointManager(out / "checkpoints" / "actor").save(6, lambda d: (d / "state.bin").write_bytes(b"x"))
    job = _job(out)  # a previous run's checkpoint; this job never claimed the directory
    job.settle_position()
    assert job.position.checkpoint is None


def test_sigterm_raises_keyboard_interrupt_inside_the_watch_and_is_told_apart() -> None:
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        watch = InterruptWatch()
        with pytest.raises(KeyboardInterrupt), watch:
            signal.raise_signal(signal.SIGTERM)  # the handler runs before raise_signal returns
        assert watch.seen and watch.terminated
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the default is back after the watch
    finally:
        signal.signal(signal.SIGTERM, previous)
    message = interrupted_message(RunPosition(Path("out"), step=3), "terminated by SIGTERM")
    assert message.startswith("terminated by SIGTERM at step 3; no checkpoint was completed in out")


def test_sighup_stops_the_job_as_sigterm_does_unless_nohup_ignores_it() -> None:
    """Probes7 (issue 35): closing the terminal of a job (SIGHUP) killed it outright, exit 129 and
    no word: no stop at a step with the line naming the checkpoint, ranks and the directory left
    as they were (a run --overwrite set aside not put back). It now takes SIGTERM's path, with
    its own words and 128 + 1; under nohup (SIGHUP ignored) it is left alone."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        watch = InterruptWatch()
        with pytest.raises(KeyboardInterrupt), watch:
            signal.raise_signal(signal.SIGHUP)
        assert watch.seen and watch.terminated
        assert (watch.how, watch.exit_status) == ("stopped by SIGHUP (its terminal closed)", 129)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup
        with InterruptWatch() as ignoring:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            signal.raise_signal(signal.SIGHUP)
        assert not ignoring.seen
    finally:
        signal.signal(signal.SIGHUP, previous)
    for signum, words, status in ((signal.SIGTERM, "terminated by SIGTERM", 143), (signal.SIGINT, "interrupted", 130)):
        watch = InterruptWatch()
        watch.signum = signum
        assert (watch.how, watch.exit_status) == (words, status)


def _failing_run(out: Path, exc: BaseException):
    """A ``Job.run`` that takes its directory, completes the checkpoint of step 4, and
    raises ``exc`` in step 6 (a plugin's hook raising mid-training, probes7's case 35)."""

    def run(job: Job) -> None:
        job.rundir.claim()
        try:
            CheckpointManager(out / "checkpoints" / "actor").save(4, lambda d: (d / "state.bin").write_bytes(b"x"))
            job.position.step = 6
            raise exc
        finally:
            job.rundir.release()

    return run


def test_a_failure_mid_training_ends_with_its_traceback_then_the_closing_line(tmp_path, monkeypatch, capsys) -> None:
    """Issue 35, round 7 (probes7 35): an extension raising in a hook mid-training exited 1
    with its traceback but no line naming the last complete checkpoint, which an interruption,
    a full disk or a non-finite stop all give."""
    from geartrain.trainer import run as run_module

    out = tmp_path / "run"
    monkeypatch.setattr(
        run_module, "load_train_config", lambda path, overrides: load_train_config(path, overrides, check_plugins=False)
    )
    monkeypatch.setattr(Job, "run", _failing_run(out, RuntimeError("boom inside optimizer_step\nmore detail")))
    assert run_module.train_from_cli(str(MAIN_CONFIG), [f"trainer.output_dir={out}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback (most recent call last):" in err
    assert "RuntimeError: boom inside optimizer_step" in err
    assert err[-1] == (
        "failed (RuntimeError: boom inside optimizer_step) at step 6; the last complete checkpoint is step 4; "
        "continue with --resume"
    )


def test_bad_input_found_mid_training_stays_the_clis_one_line(tmp_path, monkeypatch) -> None:
    """A GeartrainError (bad input, exit 2 through the CLI) is not turned into a failure."""
    from geartrain.errors import DataError
    from geartrain.trainer import run as run_module

    out = tmp_path / "run"
    monkeypatch.setattr(
        run_module, "load_train_config", lambda path, overrides: load_train_config(path, overrides, check_plugins=False)
    )
    monkeypatch.setattr(Job, "run", _failing_run(out, DataError("row 3: bad")))
    with pytest.raises(DataError, match="row 3: bad"):
        run_module.train_from_cli(str(MAIN_CONFIG), [f"trainer.output_dir={out}"])


def test_sigusr1_stops_the_job_as_sigterm_does() -> None:
    """Issue 35, round 13: SIGUSR1 (what Slurm's ``--signal=USR1@60`` sends before a job's
    time limit) killed a run on the spot, exit 138, no line naming the step or the checkpoint,
    its lock left behind. It takes SIGTERM's path, with its own words and 128 + 10."""
    previous = signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    try:
        watch = InterruptWatch()
        with pytest.raises(KeyboardInterrupt), watch:
            signal.raise_signal(signal.SIGUSR1)
        assert watch.seen and watch.terminated
        assert watch.how.startswith("stopped by SIGUSR1") and watch.exit_status == 138
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL, "the watch puts the disposition back"
    finally:
        signal.signal(signal.SIGUSR1, previous)
