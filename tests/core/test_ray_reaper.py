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
from geartrain.cluster.ray_reaper import start_reaper, stop_reaper
session = os.environ["SESSION"]  # not in the driver's own command line, as with Ray
# a "raylet" with a "worker" child, and an "agent": what Ray starts, by command line
raylet = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)",
    f"--session-dir={session}"])
agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", f"--session_dir={session}"])
pipe = start_reaper(session)
time.sleep(1.0)
print(raylet.pid, agent.pid, flush=True)
if sys.argv[2] == "clean":
    stop_reaper(pipe)
    print("stopped", flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("end", ["killed", "clean"])
def test_the_session_dies_with_a_killed_driver_and_only_then(tmp_path: Path, end: str) -> None:
    from geartrain.cluster.ray_reaper import session_processes

    session = str(tmp_path / "session_2026-11-26_00-00-00_000000_1")
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, "x", end],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), SESSION=session),
    )
    try:
        assert driver.stdout is not None
        raylet, agent = map(int, driver.stdout.readline().split())
        if end == "clean":
            assert driver.stdout.readline().strip() == "stopped"
        procs = session_processes(session)
        assert raylet in procs and agent in procs and len(procs) == 3, procs  # the worker is the raylet's child
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + (10 if end == "killed" else 3)
        while any(_alive(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in procs if _alive(p)]
        if end == "killed":
            assert left == [], "the session outlived its driver"
        else:
            assert sorted(left) == sorted(procs), "a driver that stopped Ray itself had its processes reaped"
    finally:
        for pid in session_processes(session):
            os.kill(pid, signal.SIGKILL)
