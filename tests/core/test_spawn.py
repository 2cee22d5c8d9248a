"""geartrain.testing.spawn.run_ranks: the gloo spawner the engine suites share (one world,
each rank's result back in rank order, a failing rank's traceback in the error)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

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


@dataclass
class _NotPlain:
    rank: int


def _tensors_and_an_object(rank: int, world: int) -> dict[str, object]:
    values = {"t": torch.arange(3, dtype=torch.bfloat16) + rank, "nested": ([rank, 0.5], {"s": "x", "none": None})}
    if rank == 1:
        values["object"] = _NotPlain(rank)  # torch.save writes it; a weights_only load refuses it
    return values


def test_ranks_form_one_world_and_results_come_back_in_rank_order() -> None:
    results = run_ranks(_sum_ranks, 2, 10.0)
    assert results == [{"rank": r, "world": 2, "sum": 30.0, "threads": 1} for r in range(2)]


def test_a_failing_rank_is_reported_with_its_traceback_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's spawn leaves a ``pytorch-errorfile-*.pickle`` in the temporary directory for
    each failed rank (one per failing test of a full run piled up in /tmp): removed."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"(?s)_fail_on_rank_one failed on 2 ranks:.*rank one broke"):
        run_ranks(_fail_on_rank_one, 2)
    assert list(tmp_path.iterdir()) == []


def test_results_are_read_back_as_plain_data_only_and_anything_else_names_the_rank() -> None:
    """Records go through torch.save / torch.load(weights_only=True): tensors and plain
    containers come back as they were; a rank that returns another object (here a
    dataclass) is named, with the class, instead of having it unpickled."""
    with pytest.raises(RuntimeError, match=r"^_tensors_and_an_object on rank 1: .*test_spawn\._NotPlain\)$"):
        run_ranks(_tensors_and_an_object, 2)
    one = run_ranks(_tensors_and_an_object, 1)[0]
    assert set(one) == {"t", "nested"} and one["nested"] == ([0, 0.5], {"s": "x", "none": None})
    assert one["t"].dtype == torch.bfloat16 and torch.equal(one["t"], torch.arange(3, dtype=torch.bfloat16))
