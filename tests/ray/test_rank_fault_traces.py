"""A rank killed by a fatal signal (a native abort: heap corruption, a segfault in a
library) leaves the Python stack of every one of its threads in its log, next to the
native trace, not only the crashing thread's (Ray's own faulthandler setting): issue 38."""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from geartrain.cluster.ray_placement import RankFailure, RayPlacement
from geartrain.trainer.config import ClusterConfig
from geartrain.types import EngineContext

pytestmark = [pytest.mark.slow]


def _side_thread_waits_here(started: threading.Event, never: threading.Event) -> None:
    started.set()
    never.wait()


def _main_thread_crashes_here(signum: int) -> None:
    os.kill(os.getpid(), signum)


class CrashesOnCall:
    """A worker that starts a named side thread, then kills its own process by a signal."""

    def __init__(self, *, ctx: EngineContext) -> None:
        started, self._never = threading.Event(), threading.Event()
        threading.Thread(target=_side_thread_waits_here, args=(started, self._never), daemon=True).start()
        started.wait()

    def crash(self, signum: int) -> None:
        _main_thread_crashes_here(signum)


@pytest.fixture
def placement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RayPlacement]:
    """A local Ray instance whose ranks import this file's worker."""
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    cluster = ClusterConfig(
        placement="ray", resources_per_rank={"cpus": 0.5}, heartbeat_timeout_s=60.0, call_timeout_s={"step": 120.0}
    )
    placement = RayPlacement(cluster, log_dir=tmp_path)
    try:
        yield placement
    finally:
        placement.close()


@pytest.mark.parametrize(
    ("signum", "fatal"), [(signal.SIGABRT, "Aborted"), (signal.SIGSEGV, "Segmentation fault")], ids=["abrt", "segv"]
)
def test_a_rank_killed_by_a_signal_leaves_every_threads_stack_in_its_log(
    placement: RayPlacement, tmp_path: Path, signum: int, fatal: str
) -> None:
    group = placement.group("actor", CrashesOnCall, world_size=1)
    with pytest.raises(RankFailure) as failure:
        group.submit_rank(0, "crash", int(signum)).result()
    assert "died" in str(failure.value), str(failure.value)
    log = (tmp_path / "actor-rank0.log").read_text()
    assert f"Fatal Python error: {fatal}" in log, log[-3000:]
    # all threads: the crashing one is "Current thread", the others follow by id
    # (Ray's own setting, the crashing thread alone, writes "Stack (most recent call first)")
    assert re.search(r"Current thread 0x[0-9a-f]+ .*\n(  File .*\n)*?  File .*_main_thread_crashes_here", log), log[
        -3000:
    ]
    assert re.search(r"\nThread 0x[0-9a-f]+ .*\n(  File .*\n)*?  File .*_side_thread_waits_here", log), log[-3000:]
    assert re.search(r"\nThread 0x[0-9a-f]+ .*\n(  File .*\n)*?  File .*in _heartbeat", log), log[-3000:]
