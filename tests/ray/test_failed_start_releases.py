"""A rank pool whose start-up fails releases what it took: its rank processes and its
placement group, which is named after the driver's process. Left behind, the next pool of
that name could never start (seen in a `make test` beside a CPU hog: one start-up past its
deadline, then 108 tests of the Ray suite failed with "placement group ... already exists")."""

from __future__ import annotations

from pathlib import Path

import pytest
from geartrain.cluster import ray_placement
from geartrain.cluster.ray_placement import RankFailure, RankPool
from geartrain.trainer.config import ClusterConfig, RankResources

pytestmark = [pytest.mark.slow]


def test_a_pool_that_fails_to_start_leaves_no_ranks_and_no_placement_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray
    from ray.util import placement_group_table

    cluster = ClusterConfig(placement="ray", resources_per_rank=RankResources(cpus=0.5))
    placement = ray_placement.RayPlacement(cluster, log_dir=tmp_path)
    try:
        real_get = RankPool.get

        def failing_rendezvous(self: RankPool, refs: list, role: str, method: str, **kwargs: object) -> list:
            if method == "rendezvous_address":  # after the ranks answered: their processes exist
                raise RankFailure("rank 0 of 2 did not answer during start-up (simulated)", role=role, rank=0)
            return real_get(self, refs, role, method, **kwargs)

        started: list = []
        real_release = RankPool._release

        def recording_release(self: RankPool) -> None:
            started.extend(self.hosts)
            real_release(self)

        monkeypatch.setattr(RankPool, "get", failing_rendezvous)
        monkeypatch.setattr(RankPool, "_release", recording_release)
        with pytest.raises(RankFailure, match="simulated"):
            RankPool("startfail", 2, cluster, tmp_path)
        monkeypatch.setattr(RankPool, "get", real_get)

        table = placement_group_table()
        ours = [pg for pg in table.values() if pg["name"].startswith("geartrain-startfail-")]
        left = [pg for pg in ours if pg["state"] != "REMOVED"]
        assert left == [], left
        assert len(started) == 2
        for host in started:  # killed: a call fails (it would answer, were the process alive)
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(host.where.remote())

        pool = RankPool("startfail", 2, cluster, tmp_path)  # the same name starts now
        try:
            assert [w["pid"] for w in pool.where] and len(pool.where) == 2
        finally:
            pool.close()
    finally:
        placement.close()
