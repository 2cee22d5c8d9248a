"""DAPO's batch-level pieces (Yu et al., "DAPO: an open-source LLM RL system at scale",
arXiv:2503.14476), as pure functions the trainer applies when configured:

* :func:`overlong_penalty`: the soft length penalty over a buffer before the length limit;
* :func:`informative_groups`: dynamic sampling's filter, which keeps only the groups whose
  rewards are not all equal (a group of equal rewards has zero advantage under every
  group-baseline estimator, so it only dilutes the batch).

Clip-higher (``clip_ratio_high``) and the token-level loss (``token-mean``) are options of
the policy loss and the aggregation.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


def overlong_penalty(lengths: torch.Tensor, *, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """The overlong reward shaping of DAPO (verl's ``overlong_buffer``), added to each
    sample's score: with ``expected = max_length - buffer`` and ``exceed = length -
    expected``, the penalty is ``min(-exceed / buffer * factor, 0)``: 0 up to ``expected``
    tokens, falling linearly to ``-factor`` at ``max_length``. ``lengths`` are the response
    token counts ``[B]``; returns ``[B]`` float (<= 0)."""
    if buffer <= 0 or buffer > max_length:
        raise ValueError(f"overlong buffer must be in 1..max_length ({max_length}), got {buffer}")
    exceed = lengths.to(torch.float64) - (max_length - buffer)
    return torch.clamp(-exceed / buffer * factor, max=0.0).to(torch.float32)


def informative_groups(scores: torch.Tensor, group_ids: Sequence[Hashable]) -> tuple[list[int], list[Hashable]]:
    """Dynamic sampling's filter: ``(rows to keep, ids of the dropped groups)``.

    A group is dropped when all its scores are equal (std 0, verl's ``filter_groups``
    criterion; a group of one is therefore always dropped). Kept rows stay in their order.
    """
    if len(group_ids) != scores.shape[0]:
        raise ValueError(f"{len(group_ids)} group ids for {scores.shape[0]} scores")
    rows_of: dict[Hashable, list[int]] = {}
    for row, gid in enumerate(group_ids):
        rows_of.setdefault(gid, []).append(row)
    keep: list[int] = []
    dropped: list[Hashable] = []
    for gid, rows in rows_of.items():
        values = scores[rows]
        if len(rows) > 1 and bool((values != values[0]).any()):
            keep.extend(rows)
        else:
            dropped.append(gid)
    return sorted(keep), dropped
