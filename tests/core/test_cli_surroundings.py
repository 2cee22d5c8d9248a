"""The command's surroundings changing under it (issue 35, round 11): the reader of a job's
standard output leaving (``geartrain train ... | head``) does not stop the run (the first
sample table after it raised BrokenPipeError and killed training at step 1; without tables,
a finished run was reported as failed at its last line, before its curves were drawn): the
job goes on with its output discarded. A working directory removed before the command
starts is named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from geartrain.testing.fakes import write_fake_job

CHILD = """
import signal, sys
from geartrain.cli import main
from geartrain.testing.fakes import FakeBackends

# Ctrl-C as in a terminal: a suite started in the background ignores SIGINT, and so would we
signal.signal(signal.SIGINT, signal.default_int_handler)

with FakeBackends().registered():
    rc = main(["train", *sys.argv[1:]])
print("and after the job", flush=True)  # the reader may be gone: no traceback either
sys.exit(rc)
"""


def test_a_job_whose_stdout_reader_left_finishes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    job = write_fake_job(tmp_path, out, "total_steps = 3\nsave_every = 1\nprogress = false\nexport_hf = false\n")
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(job), "trainer.print_completions=2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    assert proc.stdout is not None
    proc.stdout.close()  # the reader leaves before the job's first line
    _, err = proc.communicate(timeout=600)  # a hang guard only
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    steps = [json.loads(line).get("step") for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 3


def test_a_removed_working_directory_is_named(tmp_path: Path) -> None:
    """Issue 35, round 11: run from a directory removed after the shell entered it, the
    command died in torch's import ("Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so")."""
    gone = tmp_path / "gone"
    gone.mkdir()
    job = Path(__file__).resolve().parents[2] / "examples" / "arithmetic" / "grpo.toml"
    proc = subprocess.run(
        ["sh", "-c", 'cd "$1" && rmdir "$1" && exec "$2" -m geartrain.cli check "$3"', "sh", gone, sys.executable, job],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)),
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "error: the working directory no longer exists (it was removed after the shell entered it); "
        "cd to an existing directory and run the command again"
    ]


REMOVER = """
import os, shutil, signal


class RemoveTheRun:
    def on_save(self, step, path):
        if step == 2:
            shutil.rmtree({out!r})
            os.kill(os.getpid(), signal.SIGINT)  # the job stops here, before anything writes there again
"""


def test_a_run_directory_removed_under_the_job_names_no_checkpoint(tmp_path: Path) -> None:
    """Issue 35, round 11: after ``rm -rf`` of the output directory at step 3, the job's last
    line said "the last complete checkpoint is step 0; continue with --resume": nothing was
    left to continue from."""
    out = tmp_path / "run"
    (tmp_path / "remover.py").write_text(REMOVER.format(out=str(out)))
    job = write_fake_job(
        tmp_path,
        out,
        "total_steps = 4\nsave_every = 1\nprogress = false\nexport_hf = false\n"
        'callbacks = ["remover.py:RemoveTheRun"]\n',
    )
    # in a child: the failed job's inline roles stay in its process (torch.distributed included)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(job)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        timeout=600,  # a hang guard only
    )
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 130, proc.stderr
    assert err[-1].startswith("interrupted at step 2; "), err[-1]
    assert err[-1].endswith(f"{out} was removed while the job ran: none of its checkpoints is left"), err[-1]


REMOVER_ONLY = """
import os, shutil


class RemoveTheRun:
    def on_step_end(self, step, metrics):
        if step == 2:
            shutil.rmtree({out!r})
            if {again!r}:
                os.mkdir({out!r})  # made again, empty: still not the run's directory
"""


@pytest.mark.parametrize("again", [False, True], ids=["removed", "removed-and-made-again"])
def test_a_run_directory_removed_under_the_job_stops_it_in_one_line(tmp_path: Path, again: bool) -> None:
    """Issue 35 (known since round 11): after ``rm -rf`` of the output directory the job went
    on, its next save made the directory again holding a checkpoint and nothing else, and
    TensorBoard's writer thread failed with two tracebacks (exit 1) naming a file it could not
    open. It stops at the next write, one line, exit 2, and writes nothing there again."""
    out = tmp_path / "run"
    (tmp_path / "remover.py").write_text(REMOVER_ONLY.format(out=str(out), again=again))
    job = write_fake_job(
        tmp_path,
        out,
        "total_steps = 5\nsave_every = 1\nprogress = false\nexport_hf = false\n"
        'callbacks = ["remover.py:RemoveTheRun"]\n',
    )
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(job)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        timeout=600,  # a hang guard only
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {out} was removed while the job ran (noticed at step 2): its checkpoints and metrics went "
        "with it, so the job stopped; start it again"
    ]
    assert (list(out.iterdir()) == []) if again else not out.exists()


WINDING_DOWN = """
import atexit, os, signal, sys, threading
from geartrain.trainer.run import exit_at_once_on_sigint

# Python's own Ctrl-C handling, as in a terminal: a suite started in the background (nohup,
# `make test &`) ignores SIGINT, its children inherit that, and Python then installs no handler
signal.signal(signal.SIGINT, signal.default_int_handler)

def a_second_ctrl_c_while_winding_down():
    os.kill(os.getpid(), signal.SIGINT)
    threading.Event().wait(600)  # what an atexit callback that waits looks like; Ctrl-C ends it

atexit.register(a_second_ctrl_c_while_winding_down)  # as tqdm's and torch's: at import, before the job
if sys.argv[1] == "after-the-line":  # as an interrupted job registers it
    atexit.register(exit_at_once_on_sigint, 130)
assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # untouched until the exit
sys.exit(130)
"""


@pytest.mark.parametrize("mode", ["after-the-line", "python-default"])
def test_a_second_ctrl_c_after_the_jobs_last_line_says_nothing_more(mode: str) -> None:
    """Issue 35, round 11: two Ctrl-C a few ms apart: the job's "interrupted at step N" line,
    then 5-10 lines of "Exception ignored in atexit callback ... KeyboardInterrupt"."""
    proc = subprocess.run(
        [sys.executable, "-c", WINDING_DOWN, mode],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        timeout=600,  # a hang guard only
    )
    assert proc.returncode == 130
    if mode == "after-the-line":
        assert proc.stderr == ""
    else:  # what the job's last line was followed by before
        assert "Exception ignored in atexit callback" in proc.stderr and "KeyboardInterrupt" in proc.stderr


def _child(job: Path, *, stdout: Any, stderr: Any, env: dict[str, str] | None = None) -> int:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(job), "trainer.print_completions=2"],
        stdout=stdout,
        stderr=stderr,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **(env or {})),
        timeout=600,  # a hang guard only
    )
    return proc.returncode


def _last_step(out: Path) -> int:
    return [json.loads(line).get("step") for line in (out / "metrics.jsonl").read_text().splitlines()][-1]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_standard_output_on_a_full_device_is_said_once_and_the_run_finishes(tmp_path: Path) -> None:
    """Issue 35, round 13: `train ... > run.log` on a full disk stopped the run at step 0,
    blaming the run directory's disk ("no space left on /dev/vda ... in <output_dir>"),
    which had room: standard output was the culprit."""
    out = tmp_path / "run"
    job = write_fake_job(tmp_path, out, "total_steps = 3\nsave_every = 1\nprogress = false\nexport_hf = false\n")
    with open("/dev/full", "w") as full, (tmp_path / "err.txt").open("w") as err:
        rc = _child(job, stdout=full, stderr=err)
    said = (tmp_path / "err.txt").read_text()
    assert rc == 0, said
    assert said.count("note: standard output cannot be written (No space left on device)") == 1, said
    assert "Traceback" not in said, said
    assert _last_step(out) == 3


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_standard_error_on_a_full_device_does_not_stop_the_run(tmp_path: Path) -> None:
    """Issue 35, round 13: with stderr on a full device the progress bar's write failed with
    ENOSPC, taken for the run directory's disk: the run stopped at step 0 (exit 1)."""
    out = tmp_path / "run"
    job = write_fake_job(tmp_path, out, "total_steps = 3\nsave_every = 1\nprogress = true\nexport_hf = false\n")
    with open("/dev/full", "w") as full:
        rc = _child(job, stdout=subprocess.DEVNULL, stderr=full)
    assert rc == 0
    assert _last_step(out) == 3


def test_a_path_the_terminal_cannot_encode_is_written_escaped(tmp_path: Path) -> None:
    """Issue 35, round 13: with PYTHONIOENCODING=ascii and an output_dir named run_é, the run
    trained and exported, then its line "exported the policy to ..." raised
    UnicodeEncodeError: a traceback, exit 1, and a finished run reported as failed."""
    out = tmp_path / "run_\u00e9"
    job = write_fake_job(tmp_path, out, "total_steps = 2\nprogress = false\nexport_hf = false\n")
    with (tmp_path / "out.txt").open("w") as stdout, (tmp_path / "err.txt").open("w") as stderr:
        rc = _child(job, stdout=stdout, stderr=stderr, env={"PYTHONIOENCODING": "ascii"})
    assert rc == 0, (tmp_path / "err.txt").read_text()
    assert "run_\\xe9" in (tmp_path / "out.txt").read_text()
    assert _last_step(out) == 2


def test_curves_that_cannot_be_drawn_do_not_fail_a_finished_run(tmp_path: Path) -> None:
    """Issue 35, round 13: with an MPLBACKEND matplotlib does not know (a shell profile's
    leftover) the run trained and exported, then the optional plot's import raised: a
    traceback, exit 1, and a finished run reported as failed ("continue with --resume")."""
    out = tmp_path / "run"
    job = write_fake_job(tmp_path, out, "total_steps = 2\nprogress = false\nexport_hf = false\nplot = true\n")
    with (tmp_path / "out.txt").open("w") as stdout, (tmp_path / "err.txt").open("w") as stderr:
        rc = _child(job, stdout=stdout, stderr=stderr, env={"MPLBACKEND": "nonsense"})
    said = (tmp_path / "out.txt").read_text()
    assert rc == 0, (tmp_path / "err.txt").read_text()
    assert "note: the curves were not drawn (ValueError: Key backend: 'nonsense'" in said, said
    assert _last_step(out) == 2 and not (out / "curves.png").exists()


def test_a_torch_logs_setting_torch_refuses_is_one_line() -> None:
    """Issue 35, round 13: TORCH_LOGS=garbage printed torch's 38-line import traceback."""
    job = Path(__file__).resolve().parents[2] / "examples" / "arithmetic" / "grpo.toml"
    proc = subprocess.run(
        [sys.executable, "-m", "geartrain.cli", "check", str(job)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), TORCH_LOGS="garbage"),
        timeout=600,  # a hang guard only
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "error: torch refuses TORCH_LOGS='garbage' (Invalid log settings: garbage, must be a comma separated list of "
        "fully); unset it, or see TORCH_LOGS=help for valid names"
    ], proc.stderr


@pytest.mark.skipif(not Path("/proc/self/mounts").is_file(), reason="needs Linux's mount table")
def test_an_output_dir_on_a_pseudo_file_system_is_refused_by_the_checks() -> None:
    """Issue 35, round 13: trainer.output_dir under /proc passed ``check``; ``train`` failed in
    a 25-line traceback from mkdir, advising --overwrite."""
    from geartrain.trainer.rundir import RunDirectory, RunDirectoryError

    with pytest.raises(RunDirectoryError) as info:
        RunDirectory(Path("/proc/geartrain_run")).check()
    assert "is on a file system that stores no files (/proc" in str(info.value), str(info.value)
