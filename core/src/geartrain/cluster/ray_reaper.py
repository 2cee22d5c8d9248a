"""Stops a local Ray instance whose driver died without stopping it.

A job that starts its own local Ray instance (``cluster.address`` unset) also starts this
small process (:func:`start_reaper`), holding the write end of a pipe to it. The reaper
blocks reading the pipe. When the driver ends normally it writes ``done`` and the reaper
exits; when the driver is killed (SIGKILL, OOM) the kernel closes the pipe, the reaper reads
EOF at once and stops every process of that Ray session — GCS, raylet, the dashboard and
runtime-env agents, the ranks — found by the ``--session-dir`` their command lines carry
(with their descendants): nothing is left orphaned for Ray's own minutes-long timeouts.
While it waits it notes the session's processes every second, because GCS and raylet die
with the driver (Ray ties them to it) and the agents they started, renamed
``ray::DashboardAgent`` and no longer naming the session, are then orphans found only by
that note.

Run as ``python -m geartrain.cluster.ray_reaper SESSION_DIR``; imports nothing but the
standard library (it must start in a fraction of a second).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

_DONE = b"done\n"
_SELF = b"geartrain.cluster.ray_reaper"  # the reaper's own command line names the session too


def session_processes(session_dir: str) -> list[int]:
    """Pids of the processes whose command line names ``session_dir``, with every
    descendant of theirs (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    roots = []
    needle = session_dir.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            cmdline = (entry / "cmdline").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(pid)
        if needle in cmdline and pid != os.getpid() and _SELF not in cmdline:
            roots.append(pid)
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.add(pid)
        todo += children.get(pid, [])
    found.discard(os.getpid())
    return sorted(found)


def _started(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks since boot), to tell it from a reused pid."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def snapshot(session_dir: str) -> dict[int, int | None]:
    """The session's processes now, with their start times."""
    return {pid: _started(pid) for pid in session_processes(session_dir)}


def reap(session_dir: str, known: dict[int, int | None] | None = None, grace_s: float = 3.0) -> list[int]:
    """SIGTERM the session's processes (those found now, and those of ``known`` that are
    still the same processes), then SIGKILL what is left after ``grace_s``. Returns the
    pids signalled."""
    found = snapshot(session_dir)
    for pid, started in (known or {}).items():
        if started is not None and _started(pid) == started:
            found[pid] = started
    pids = sorted(found)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace_s
        while sig == signal.SIGTERM and time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_reaper(session_dir: str) -> IO[bytes]:
    """Start the reaper for ``session_dir``; returns the pipe to keep open for as long as
    the driver lives (:func:`stop_reaper` when Ray was stopped normally)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "geartrain.cluster.ray_reaper", session_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the driver's process group is not for it
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    assert proc.stdin is not None
    return proc.stdin


def stop_reaper(pipe: IO[bytes]) -> None:
    """Tell the reaper the driver stopped Ray itself."""
    try:
        pipe.write(_DONE)
        pipe.close()
    except (BrokenPipeError, OSError):
        pass


def main(argv: list[str]) -> int:
    import select

    session_dir = argv[1]
    known: dict[int, int | None] = {}
    while True:  # until the driver writes or dies, noting the session's processes every second
        ready, _, _ = select.select([sys.stdin.buffer], [], [], 1.0)
        if ready:
            break
        known.update(snapshot(session_dir))
    if sys.stdin.buffer.readline() != _DONE:
        reap(session_dir, known)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
