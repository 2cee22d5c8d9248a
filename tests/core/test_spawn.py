"""geartrain.testing.spawn.run_ranks: the gloo spawner the engine suites share (one world,
each rank's result back in rank order, a failing rank's traceback in the error)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from geartrain.testing.spawn import run_ranks


def _sum_ranks(rank: int, world: int, scale: float) -> dict[str, object]:
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)  # over the spawned world
    return {
        "rank": rank,
        "world": dist.get_world_size(),
        "sum": float(value) * scale,
        "threads": torch.get_num_threads(),
    }


def _fail_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("rank one broke")


def test_ranks_form_one_world_and_results_come_back_in_rank_order() -> None:
    results = run_ranks(_sum_ranks, 2, 10.0, timeout=120)
    assert results == [{"rank": r, "world": 2, "sum": 30.0, "threads": 1} for r in range(2)]


def test_a_failing_rank_is_reported_with_its_traceback() -> None:
    with pytest.raises(RuntimeError, match=r"(?s)_fail_on_rank_one failed on 2 ranks:.*rank one broke"):
        run_ranks(_fail_on_rank_one, 2, timeout=120)
