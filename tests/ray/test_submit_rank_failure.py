"""A call sent to one rank alone (``RayWorkerGroup.submit_rank``: the separate rollout's
requests and weight loads go to one replica) that fails is reported as that rank's failure:
the message names the rank the call went to and quotes its log, not rank 0's, whether the
rank raised, was killed, or stopped answering (its heartbeat)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from geartrain.cluster.ray_placement import RankFailure, RayPlacement
from geartrain.trainer.config import ClusterConfig
from geartrain.types import EngineContext

pytestmark = [pytest.mark.slow]


class FailsOnRank:
    """A worker whose ``work`` raises on rank ``bad`` and answers its rank elsewhere."""

    def __init__(self, bad: int, *, ctx: EngineContext) -> None:
        self.bad, self.rank = bad, ctx.rank

    def work(self) -> int:
        if self.rank == self.bad:
            raise ValueError(f"work failed on rank {self.rank}")
        return self.rank

    def pid(self) -> int:
        return os.getpid()


@pytest.fixture
def placement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RayPlacement]:
    """A local Ray instance; a silent rank is reported after 30 s, a step call after 600 s:
    the test needs only the heartbeat to beat the call deadline. (5 s failed a fresh-clone
    make test at load ~5: a healthy rank's beat came more than 5 s apart while it built.)"""
    # the ranks (started by the local Ray instance below) import FailsOnRank from this file
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    cluster = ClusterConfig(
        placement="ray", resources_per_rank={"cpus": 0.5}, heartbeat_timeout_s=30.0, call_timeout_s={"step": 600.0}
    )
    placement = RayPlacement(cluster, log_dir=tmp_path)
    try:
        yield placement
    finally:
        placement.close()


def test_a_failed_call_to_one_rank_names_that_rank(placement: RayPlacement) -> None:
    group = placement.group("rollout", FailsOnRank, 1, world_size=2)
    assert group.submit_rank(0, "work").result() == 0
    with pytest.raises(RankFailure) as failure:
        group.submit_rank(1, "work").result()
    text = str(failure.value)
    assert "role 'rollout' rank 1 of 2" in text, text
    assert "work failed on rank 1" in text and "rollout-rank1.log" in text, text


def test_a_killed_or_stopped_rank_called_alone_is_named(placement: RayPlacement) -> None:
    group = placement.group("rollout", FailsOnRank, -1, world_size=3)
    pids = [group.submit_rank(r, "pid").result() for r in range(3)]
    # stopped: its heartbeat stops, found after heartbeat_timeout_s (not the 600 s deadline)
    os.kill(pids[2], signal.SIGSTOP)
    with pytest.raises(RankFailure) as stopped:
        group.submit_rank(2, "work").result()
    text = str(stopped.value)
    assert "role 'rollout' rank 2 of 3" in text and "heartbeat stopped" in text, text
    assert "rollout-rank2.log" in text and "rank 0 of 3" not in text, text
    # killed (an OOM kill, an engine crash): named as the rank that died
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(RankFailure) as killed:
        group.submit_rank(1, "work").result()
    text = str(killed.value)
    assert "role 'rollout' rank 1 of 3" in text and "died" in text, text
    assert "rollout-rank1.log" in text and "rank 0 of 3" not in text, text
    assert group.submit_rank(0, "work").result() == 0  # the others still answer
    os.kill(pids[2], signal.SIGCONT)


def test_a_temporary_log_directory_stays_when_an_error_quoted_a_log_in_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a log_dir the ranks log to a temporary directory that close() removes (probes7,
    issue 35: one was left in /tmp per run), except when a failure named a log there."""
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    placement = RayPlacement(ClusterConfig(placement="ray", resources_per_rank={"cpus": 0.5}))
    try:
        group = placement.group("rollout", FailsOnRank, 1, world_size=2)
        with pytest.raises(RankFailure) as failure:
            group.submit_rank(1, "work").result()
    finally:
        placement.close()
    log = placement.log_dir / "rollout-rank1.log"
    assert str(log) in str(failure.value)
    assert "rollout.work" in log.read_text()  # the log the error quoted, kept
