"""A call sent to one rank alone (``RayWorkerGroup.submit_rank``: the separate rollout's
requests and weight loads go to one replica) that fails is reported as that rank's failure:
the message names the rank the call went to and quotes its log, not rank 0's."""

from __future__ import annotations

import os
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


def test_a_failed_call_to_one_rank_names_that_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the ranks (started by the local Ray instance below) import FailsOnRank from this file
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    placement = RayPlacement(ClusterConfig(placement="ray", resources_per_rank={"cpus": 0.5}), log_dir=tmp_path)
    try:
        group = placement.group("rollout", FailsOnRank, 1, world_size=2)
        assert group.submit_rank(0, "work").result() == 0
        with pytest.raises(RankFailure) as failure:
            group.submit_rank(1, "work").result()
        text = str(failure.value)
        assert "role 'rollout' rank 1 of 2" in text, text
        assert "work failed on rank 1" in text and "rollout-rank1.log" in text, text
    finally:
        placement.close()
