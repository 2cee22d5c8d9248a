"""DAPO's dynamic sampling in the trainer: generate more prompt groups until the batch holds
``target_groups`` informative ones (see :func:`geartrain.algorithms.dapo.informative_groups`),
with the number of extra generation rounds capped.

A rollout batch here carries its per-sample sequence score and correctness as metadata
(``score``, ``correct``), so they follow the rows through filtering and concatenation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from geartrain.algorithms.dapo import informative_groups
from geartrain.batch import Batch


def concat_rollouts(batches: Sequence[Batch]) -> Batch:
    """Concatenate rollout batches of the core layout (left-padded prompt of width
    ``info["prompt_length"]``, then right-padded response) whose widths differ: every
    ``[B, T]`` tensor is re-padded with zeros to the widest prompt and response parts."""
    batches = [b for b in batches if len(b)] or list(batches[:1])
    if len(batches) == 1:
        return batches[0]
    width = max(int(b.info["prompt_length"]) for b in batches)
    resp = max(b["input_ids"].shape[1] - int(b.info["prompt_length"]) for b in batches)
    padded = []
    for b in batches:
        shift = width - int(b.info["prompt_length"])
        total = b["input_ids"].shape[1]
        tensors = {}
        for key, value in b.tensors.items():
            if value.dim() >= 2 and value.shape[1] == total:
                new = value.new_zeros((value.shape[0], width + resp, *value.shape[2:]))
                new[:, shift : shift + total] = value
                value = new
            tensors[key] = value
        padded.append(Batch(tensors, b.meta, {**b.info, "prompt_length": width}, batch_size=len(b)))
    return Batch.cat(padded)


def collect_informative(
    first: Batch,
    generate_more: Callable[[int], Batch],
    *,
    target_groups: int,
    max_extra_rounds: int,
) -> tuple[Batch, dict[str, float]]:
    """Keep the informative groups of ``first`` and call ``generate_more(round)`` (round
    1, 2, ...) at most ``max_extra_rounds`` times until ``target_groups`` groups are kept;
    the surplus of the last round is cut (whole groups, first come first kept).

    When the cap is reached short of the target, the step trains on the groups it has;
    when no group at all is informative, on ``first`` unfiltered (its advantages are 0
    under group baselines, as verl would have them). Metrics (per step):
    ``dynamic_sampling/dropped_groups``, ``/refilled_groups`` (kept groups from extra
    rounds), ``/extra_rounds``, ``/kept_groups`` and ``/short`` (1 when below the target).
    """
    kept: list[Batch] = []
    n_kept = dropped = refilled = 0
    rounds = 0
    batch = first
    while True:
        rows, dropped_ids = informative_groups(torch.tensor(batch["score"], dtype=torch.float64), batch["uid"])
        dropped += len(dropped_ids)
        group_rows: dict[object, list[int]] = {}
        for row in rows:
            group_rows.setdefault(batch["uid"][row], []).append(row)
        take = list(group_rows.values())[: max(target_groups - n_kept, 0)]
        if take:
            kept.append(batch.index([row for group in take for row in group]))
            n_kept += len(take)
            refilled += len(take) if rounds > 0 else 0
        if n_kept >= target_groups or rounds >= max_extra_rounds:
            break
        rounds += 1
        batch = generate_more(rounds)
    metrics = {
        "dynamic_sampling/dropped_groups": float(dropped),
        "dynamic_sampling/refilled_groups": float(refilled),
        "dynamic_sampling/extra_rounds": float(rounds),
        "dynamic_sampling/kept_groups": float(n_kept),
        "dynamic_sampling/short": float(n_kept < target_groups),
    }
    return (concat_rollouts(kept) if kept else first), metrics
