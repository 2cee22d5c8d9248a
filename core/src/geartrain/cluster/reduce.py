"""How a step's metrics are reduced across a role's ranks (the rule, in one place).

An engine's ``forward_backward`` returns the metrics of **its own data-parallel slice**:
the loss function's metric shares summed over its micro-batches, plus its own counts
(``tokens``: real tokens of its slice, ``sequences``, ``micro_batches``). The core sums each
metric over the data-parallel ranks (:func:`sum_over_data_parallel`, called by
:meth:`geartrain.Engine.forward_backward` on every rank), so what callers and the trainer
see is global and identical on every rank. Ranks that share a data-parallel coordinate
(sequence-, tensor- or pipeline-parallel peers) hold the same slice, must report the same
metrics, and are counted once.
"""

from __future__ import annotations

from typing import Any

from geartrain.types import DataParallelCoordinates


def sum_over_data_parallel(
    metrics: dict[str, float], *, group: Any, world_size: int, dp: DataParallelCoordinates, device: str = "cpu"
) -> dict[str, float]:
    """Each key of ``metrics`` summed over the data-parallel ranks of ``group`` (a key
    missing on a rank counts 0 there). Collective over ``group``; a copy on one rank."""
    if world_size == 1 or group is None:
        return {k: float(v) for k, v in metrics.items()}
    import torch
    import torch.distributed as dist

    if world_size % dp.size:
        raise ValueError(f"{world_size} ranks do not split into {dp.size} data-parallel ranks")
    names: list[Any] = [None] * world_size
    dist.all_gather_object(names, sorted(metrics), group=group)
    keys = sorted({k for rank_keys in names for k in rank_keys})
    values = torch.tensor([float(metrics.get(k, 0.0)) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(values, group=group)
    peers = world_size // dp.size
    return {k: v / peers for k, v in zip(keys, values.tolist(), strict=True)}
