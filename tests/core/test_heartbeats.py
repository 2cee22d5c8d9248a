"""A rank's heartbeat (the thread :class:`RankHost` runs) stops when its process is stopped,
and the driver's view of the beat files (:class:`_Heartbeats`) names it after the timeout
and not before (issue 24 item 3; the Ray-level SIGSTOP tests are in
tests/ray/test_ray_failures.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from geartrain.cluster.deadlines import CALL_TIMEOUTS, call_phase
from geartrain.cluster.ray_placement import _Heartbeats

BEAT = (
    "import sys\n"
    "from geartrain.cluster.ray_placement import RankHost\n"
    "host = RankHost.__new__(RankHost)\n"
    "host._beat_path = sys.argv[1]\n"
    "host._heartbeat()\n"
)


TIMEOUT_S = 3.0  # the heartbeat timeout under test
#: a hang guard only, for waits the order of events ends (a rank's start-up, which imports torch; a
#: stopped rank going silent after TIMEOUT_S; a resumed one beating again): far above what they take
#: on a loaded machine, so it cannot decide the test there
HANG_GUARD_S = 300.0


def _wait(predicate, timeout: float) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def test_a_stopped_process_is_silent_after_the_timeout_and_only_it(tmp_path: Path) -> None:
    paths = [str(tmp_path / f"actor-rank{r}.beat") for r in range(2)]
    ranks = [
        subprocess.Popen([sys.executable, "-c", BEAT, p], env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        for p in paths
    ]
    try:
        assert _wait(lambda: all(os.path.exists(p) for p in paths), HANG_GUARD_S), "no heartbeat started"
        beats = _Heartbeats(paths)
        time.sleep(TIMEOUT_S + 0.5)  # a running rank beats every second: 3 beats late only if starved 3 s
        assert beats.silent([0, 1], TIMEOUT_S) == [], "a running rank was called silent"
        ranks[0].send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        assert _wait(lambda: beats.silent([0, 1], TIMEOUT_S) == [0], HANG_GUARD_S), beats.silent([0, 1], TIMEOUT_S)
        assert time.monotonic() - stopped >= TIMEOUT_S - 1.0  # not before the timeout (one beat of slack)
        assert _Heartbeats(paths).silent([0, 1], TIMEOUT_S, now_only=True) == [0]
        ranks[0].send_signal(signal.SIGCONT)
        assert _wait(lambda: beats.silent([0, 1], TIMEOUT_S) == [], HANG_GUARD_S), "a resumed rank stayed silent"
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()


def test_a_rank_not_started_yet_is_left_to_the_deadline(tmp_path: Path) -> None:
    beats = _Heartbeats([str(tmp_path / "never.beat")])
    time.sleep(0.3)
    assert beats.silent([0], 0.1) == [] and beats.silent([0], 0.1, now_only=True) == []


def test_each_call_has_a_phase_deadline() -> None:
    assert call_phase("build") == "build" and call_phase("save_checkpoint") == "checkpoint"
    assert call_phase("load_checkpoint") == "checkpoint" and call_phase("generate") == "step"
    assert set(CALL_TIMEOUTS) == {"build", "step", "checkpoint"}


def test_the_configs_default_deadlines_are_the_placements() -> None:
    from geartrain.trainer.config import ClusterConfig

    assert ClusterConfig().call_timeout_s == CALL_TIMEOUTS
