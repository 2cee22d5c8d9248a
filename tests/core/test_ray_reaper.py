"""The reaper stops a local Ray session's processes the moment its driver is killed, and
leaves them alone when the driver stopped Ray itself (issue 24, item 7). The "session" here
is stand-in processes carrying ``--session-dir`` in their command lines, as Ray's do; the
Ray-level test is tests/ray/test_ray_failures.py::test_a_killed_driver_leaves_no_ray_process_behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

DRIVER = """
import os, subprocess, sys, time
from pathlib import Path
from geartrain.cluster.ray_reaper import start_reaper, stop_reaper
session = os.environ["SESSION"]  # not in the driver's own command line, as with Ray
# a "raylet" with a "worker" child, and an "agent": what Ray starts, by command line
raylet = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys, time; "
    "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); print(w.pid, flush=True); "
    "time.sleep(300)",
    f"--session-dir={session}"], stdout=subprocess.PIPE, text=True)
worker = int(raylet.stdout.readline())  # the worker exists from here on
agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", f"--session_dir={session}"])
pipe = start_reaper(session)

def cmdline(p):
    try:
        return (p / "cmdline").read_bytes()
    except OSError:  # gone while scanned
        return b""

deadline = time.monotonic() + 60  # a hang guard: the scan is repeated until the reaper's command line shows
while True:  # (seen once at load 8: a single scan right after start_reaper found none)
    reaper = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and p.name != str(os.getpid())
              and b"geartrain.cluster.ray_reaper" in cmdline(p) and session.encode() in cmdline(p)]
    if reaper or time.monotonic() > deadline:
        break
    time.sleep(0.05)
print(raylet.pid, agent.pid, worker, *reaper, flush=True)
if sys.argv[2] == "clean":
    stop_reaper(pipe)
    print("stopped", flush=True)
sys.stdin.read()  # until the test kills it
"""

#: hang guards only, far above what each wait takes on a loaded machine (the reaper ends within its
#: grace_s of 3 s after its SIGTERM; a SIGKILLed process is gone once scheduled): the order of events
#: decides each test, these bounds only stop a broken reaper from hanging it
REAPER_EXIT_GUARD_S = 300.0
DEATH_AFTER_SIGKILL_GUARD_S = 120.0


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], guard_s: float) -> list[int]:
    """Wait until none of ``pids`` is alive (at most ``guard_s``, a hang guard); those still alive."""
    deadline = time.monotonic() + guard_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("end", ["killed", "clean"])
def test_the_session_dies_with_a_killed_driver_and_only_then(tmp_path: Path, end: str) -> None:
    """By the order of events, not by a clock: ``killed``: the driver dies, the reaper reaps and
    exits, and then no session process is left; ``clean``: the reaper exits on the driver's
    ``done``, the driver is killed after it, and every session process is still there."""
    from geartrain.cluster.ray_reaper import session_processes

    session = str(tmp_path / "session_2026-11-26_00-00-00_000000_1")
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, "x", end],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), SESSION=session),
    )
    try:
        assert driver.stdout is not None
        raylet, agent, worker, reaper = map(int, driver.stdout.readline().split())
        procs = session_processes(session)
        assert sorted(procs) == sorted([raylet, agent, worker]), procs  # the worker is the raylet's child
        if end == "clean":
            assert driver.stdout.readline().strip() == "stopped"
            assert _wait_gone([reaper], REAPER_EXIT_GUARD_S) == [], "the reaper did not end on the driver's done"
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        if end == "killed":
            assert _wait_gone([reaper], REAPER_EXIT_GUARD_S) == [], "the reaper did not end after its driver"
            assert _wait_gone(procs, DEATH_AFTER_SIGKILL_GUARD_S) == [], "the session outlived its driver"
        else:  # nothing is left that could reap them
            assert [p for p in procs if _alive(p)] == procs, "a driver that stopped Ray itself had its processes reaped"
    finally:
        for pid in session_processes(session):
            os.kill(pid, signal.SIGKILL)
