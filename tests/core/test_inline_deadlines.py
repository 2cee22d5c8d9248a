"""A hook that never returns in an inline job (a rank in the driver's own process) is held to
its phase's deadline, ``cluster.call_timeout_s``, as a Ray rank is (issue 35: it held the
job until Ctrl-C). Stuck in Python, the call gets an error raised inside it and the job ends
as any error does: one line, exit 2. Stuck outside Python (no exception reaches it), the
process ends with the same line and exit 2 once a grace period passed."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from geartrain.cli import main
from geartrain.cluster.deadlines import CallDeadlineExceeded
from geartrain.cluster.worker_group import InlineWorkerGroup
from geartrain.hookspecs import hookimpl
from geartrain.testing import fakes as fake_module
from geartrain.testing.fakes import FakeBackends, write_fake_job

#: a deadline the test's own calls never need (they return in microseconds when they return)
SHORT = 0.5


class Worker:
    def __init__(self, ctx: Any) -> None:
        self.stop = threading.Event()

    def spin(self) -> str:
        while not self.stop.is_set():  # a Python loop: the raised error reaches it
            pass
        return "stopped"

    def spin_and_swallow(self) -> str:
        try:
            return self.spin()
        except BaseException:  # a hook that eats every exception and returns as if done
            return "swallowed"

    def quick(self) -> int:
        return 7


def _group(step_s: float = SHORT) -> InlineWorkerGroup:
    return InlineWorkerGroup("actor", Worker, deadlines={"build": 60.0, "step": step_s, "checkpoint": 60.0})


def test_a_hook_looping_in_python_is_stopped_at_its_deadline_and_named() -> None:
    group = _group()
    with pytest.raises(CallDeadlineExceeded) as err:
        group.call("spin")
    message = str(err.value)
    assert message.startswith(f"actor.spin did not return within the {SHORT:g} s deadline of its phase")
    assert "(cluster.call_timeout_s.step)" in message and "--resume" in message
    assert f"it was in {__file__}" in message and "in spin" in message


def test_a_hook_that_swallows_the_error_and_returns_still_fails() -> None:
    with pytest.raises(CallDeadlineExceeded, match="actor.spin_and_swallow did not return"):
        _group().call("spin_and_swallow")


def test_a_call_within_its_deadline_is_untouched_and_leaves_no_watchdog() -> None:
    group = _group(step_s=60.0)
    assert [group.call("quick") for _ in range(50)] == [7] * 50
    watchdogs = [t for t in threading.enumerate() if t.name.startswith("geartrain-deadline")]
    for t in watchdogs:  # each ends as its call returns
        t.join(timeout=60.0)
    assert not any(t.is_alive() for t in watchdogs)


def test_no_deadline_without_a_cluster_setting() -> None:
    group = InlineWorkerGroup("actor", Worker)
    threading.Timer(SHORT * 4, group.worker.stop.set).start()
    assert group.call("spin") == "stopped"


def test_nothing_of_a_fired_watchdog_surfaces_after_its_call() -> None:
    """A fired watchdog's error is raised inside the call or withdrawn when the call leaves:
    it never surfaces later, in whatever the thread runs next."""
    group = _group(step_s=SHORT / 5)
    for _ in range(5):
        with pytest.raises(CallDeadlineExceeded):
            group.call("spin_and_swallow")
        total = 0
        for i in range(200_000):  # nothing may be raised here any more
            total += i
        assert total == 199_999 * 200_000 // 2


STUCK = """
import sys, time
from geartrain.cluster.worker_group import InlineWorkerGroup

class Worker:
    def __init__(self, ctx):
        pass

    def stuck(self):
        time.sleep(3600)  # in C: no Python instruction runs for the raised error

group = InlineWorkerGroup("rollout", Worker, deadlines={"build": 60.0, "step": float(sys.argv[1]), "checkpoint": 60.0})
print("calling", flush=True)
group.call("stuck")
print("returned", flush=True)
"""


def test_a_hook_stuck_outside_python_ends_the_process_with_exit_2() -> None:
    limit = 1.0
    proc = subprocess.run(
        [sys.executable, "-c", STUCK, str(limit)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        timeout=600,  # a hang guard only: the process ends after 2 x limit
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "calling\n"
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: rollout.stuck did not return within the {limit:g} s deadline of its phase")
    assert "in stuck" in line and "did not stop within 1 s of the deadline" in line


@hookimpl
def _hanging_save(self: Any, model: Any, path: Path, extra: dict[str, Any]) -> None:
    while True:  # a plugin's save that never returns
        pass


@pytest.fixture
def hanging_save(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeBackends]:
    monkeypatch.setattr(fake_module._FakeEngine, "save_checkpoint", _hanging_save)
    with FakeBackends().registered() as backends:
        yield backends


def test_an_inline_job_whose_save_hangs_ends_with_one_line_and_exit_2(
    hanging_save: FakeBackends, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = write_fake_job(tmp_path, tmp_path / "run", "total_steps = 4\nsave_every = 2\nexport_hf = false\n")
    # only the checkpoint phase is short: every other call keeps its default deadline
    rc = main(["train", str(job), "cluster.call_timeout_s.checkpoint=1", "trainer.progress=false"])
    err = capsys.readouterr().err
    assert rc == 2, err
    last = err.strip().splitlines()[-1] if err.strip() else ""
    assert last.startswith("error: actor.save_checkpoint did not return within the 1 s deadline of its phase")
    assert "(cluster.call_timeout_s.checkpoint)" in last and "in _hanging_save" in last
    assert err.strip().splitlines() == [last]  # one line, no traceback
