"""A rank runs at its driver's CPU priority. Ray starts worker processes at nice 15 unless
told otherwise, so beside any ordinary busy process a rank (the job's whole workload) got a
few percent of a core: in `make test` beside a CPU hog of four busy loops its imports took
minutes and start-up deadlines passed (issue 35). A local cluster that geartrain starts runs
its ranks at nice 0 relative to the driver (``ray_placement.RAY_WORKER_NICENESS``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from geartrain.cluster import ray_placement
from geartrain.cluster.ray_placement import RankPool
from geartrain.trainer.config import ClusterConfig, RankResources

pytestmark = [pytest.mark.slow]


def test_a_rank_runs_at_the_drivers_cpu_priority(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    assert not ray.is_initialized()  # the local cluster must be the one RayPlacement starts
    monkeypatch.delenv("RAY_worker_niceness", raising=False)  # the default, not a caller's value
    cluster = ClusterConfig(placement="ray", resources_per_rank=RankResources(cpus=0.5))
    placement = ray_placement.RayPlacement(cluster, log_dir=tmp_path)
    try:
        pool = RankPool("priority", 1, cluster, tmp_path)
        try:
            pid = pool.where[0]["pid"]
            assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0)
            assert "nice" not in (tmp_path / "priority-rank0.log").read_text()  # no warning at full priority
        finally:
            pool.close()
    finally:
        placement.close()
