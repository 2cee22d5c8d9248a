"""How a call's batch is split across data-parallel ranks and its results put back together.

Pure functions over :class:`~geartrain.batch.Batch`, tensors and metric dicts, shared by
every placement (and unit-tested without any cluster):

* :func:`partition` chooses which rows each data-parallel rank gets — contiguous slices, or
  slices balanced by token count (the way verl balances them), sizes differing by at most one,
  keeping the samples of one prompt (rows with one ``uid``) on one rank where the sizes allow,
  so an engine can run their shared prompt once;
* :func:`gather` concatenates the ranks' results and restores the caller's row order
  (a result may hold ``m`` rows per input row, e.g. ``n`` samples per prompt);
* :func:`reduce_metrics` combines the ranks' metric dicts: ``hybrid/*`` (phase-switch seconds
  and bytes) are summed over ranks, ``timing/*`` take the slowest rank, everything else is
  rank 0's (:meth:`geartrain.Engine.forward_backward` has already summed an engine's metrics
  over the data-parallel ranks, the same on every rank; see :mod:`geartrain.cluster.reduce`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from geartrain.batch import Batch
from geartrain.errors import GeartrainError
from geartrain.types import StepOutput


def row_tokens(batch: Batch) -> list[int]:
    """The token count each row costs: its ``attention_mask`` sum, or the length of its
    ``prompt_ids`` for a batch of prompts, else 1."""
    if "attention_mask" in batch.tensors.keys():
        return [int(x) for x in batch["attention_mask"].sum(-1).tolist()]
    if "prompt_ids" in batch.meta:
        return [len(p) for p in batch["prompt_ids"]]
    return [1] * len(batch)


def sample_groups(batch: Batch) -> list[list[int]] | None:
    """The rows of each prompt's samples (equal ``uid``, as the trainer's batches carry), in
    order of first appearance; None when the batch has no ``uid``."""
    if "uid" not in batch.meta:
        return None
    groups: dict[Any, list[int]] = {}
    for row, uid in enumerate(batch.meta["uid"]):
        groups.setdefault(uid, []).append(row)
    return list(groups.values())


def _assign(units: list[list[int]], tokens: list[int], sizes: list[int]) -> list[list[int]] | None:
    """Units (lists of rows) to parts of exactly ``sizes`` rows, longest unit first to the
    part with the fewest tokens that has room for all of it; None when a unit fits nowhere."""
    cost = [sum(tokens[i] for i in unit) for unit in units]
    order = sorted(range(len(units)), key=lambda u: (-cost[u], units[u][0]))
    loads = [0] * len(sizes)
    assigned: list[list[int]] = [[] for _ in sizes]
    for u in order:
        room = [p for p in range(len(sizes)) if len(assigned[p]) + len(units[u]) <= sizes[p]]
        if not room:
            return None
        p = min(room, key=lambda q: (loads[q], q))
        assigned[p].extend(units[u])
        loads[p] += cost[u]
    return [sorted(rows) for rows in assigned]


def partition(batch: Batch, parts: int, *, balance: bool) -> list[list[int]]:
    """Row indices for each of ``parts`` ranks, each list in increasing order. Sizes differ
    by at most one (the first parts larger, as :meth:`Batch.split`); with ``balance`` the
    rows are assigned longest first to the part with the fewest tokens that still has room —
    whole groups of one prompt's samples (:func:`sample_groups`) when they fit the sizes,
    single rows otherwise."""
    n = len(batch)
    base, extra = divmod(n, parts)
    sizes = [base + (1 if i < extra else 0) for i in range(parts)]
    if not balance or parts == 1:
        out, start = [], 0
        for size in sizes:
            out.append(list(range(start, start + size)))
            start += size
        return out
    tokens = row_tokens(batch)
    groups = sample_groups(batch)
    if groups is not None and len(groups) < n:
        by_group = _assign(groups, tokens, sizes)
        if by_group is not None:
            return by_group
    assigned = _assign([[i] for i in range(n)], tokens, sizes)
    assert assigned is not None  # single rows always fit
    return assigned


def dp_rows(value: Any, parts: int, *, balance: bool) -> list[list[list[int]]]:
    """Per rank, the rows it gets of each batch in ``value``: a Batch, or a list of them
    (mini-batches, one optimizer step each, every one split across the ranks)."""
    batches = value if isinstance(value, list) else [value]
    if not batches or not all(isinstance(b, Batch) for b in batches):
        raise TypeError("Dispatch.DP needs a Batch, or a list of Batches, as the first argument")
    for b in batches:
        if len(b) < parts:
            raise GeartrainError(
                f"a batch of {len(b)} rows cannot be split across {parts} data-parallel ranks: every rank needs "
                f"at least one row. Give every call at least {parts} rows (in a job: data.batch_size, "
                f"sft.batch_size and the validation prompts, validation.max_prompts) or lower parallel.dp"
            )
    per_batch = [partition(b, parts, balance=balance) for b in batches]
    return [[per_batch[k][d] for k in range(len(batches))] for d in range(parts)]


def shard_value(value: Any, rows: list[list[int]]) -> Any:
    """One rank's share of ``value`` (see :func:`dp_rows`)."""
    if isinstance(value, list):
        return [b.index(r) for b, r in zip(value, rows, strict=True)]
    return value.index(rows[0])


# ----------------------------------------------------------------------------- gather


def reduce_metrics(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """See the module docstring."""
    out = dict(per_rank[0])
    for key in out:
        if key.startswith("hybrid/"):
            out[key] = sum(float(m.get(key, 0.0)) for m in per_rank)
        elif key.startswith("timing/"):
            out[key] = max(float(m.get(key, 0.0)) for m in per_rank)
    return out


def cat_rollout_batches(batches: Sequence[Batch]) -> Batch:
    """Concatenate batches that may differ in width: each holds a left-padded prompt of
    ``info["prompt_length"]`` columns then a right-padded response. The result is laid out
    as if one call had produced all rows (prompt width and response width are the
    maxima); padding holds 0."""
    widths = {
        (b.tensors.get("input_ids").shape[1], int(b.info.get("prompt_length", 0)))
        for b in batches
        if "input_ids" in b.tensors.keys()
    }
    if len(widths) <= 1:  # one layout (equal widths with unequal prompts still need realigning)
        return Batch.cat(batches)
    prompt = max(int(b.info.get("prompt_length", 0)) for b in batches)
    resp = max(b["input_ids"].shape[1] - int(b.info.get("prompt_length", 0)) for b in batches)
    padded = []
    for b in batches:
        p = int(b.info.get("prompt_length", 0))
        r = b["input_ids"].shape[1] - p
        tensors = {}
        for key in b.tensor_keys():
            t = b[key]
            if t.dim() >= 2 and t.shape[1] == p + r:
                pad = [0, 0] * (t.dim() - 2) + [prompt - p, resp - r]
                t = torch.nn.functional.pad(t, pad)
            tensors[key] = t
        padded.append(Batch(tensors, b.meta, {**b.info, "prompt_length": prompt}))
    return Batch.cat(padded)


def _restore(rows: Sequence[int], total: int, got: int) -> list[int]:
    """Positions (in the concatenated results) of each original row's results, in order."""
    m = got // max(len(rows), 1) if rows else 0
    where: list[int] = [0] * (total * m)
    for pos, row in enumerate(rows):
        for k in range(m):
            where[row * m + k] = pos * m + k
    return where


def gather(results: Sequence[Any], rows: Sequence[list[int]], total: int) -> Any:
    """Combine one result per data-parallel rank (``results[d]`` computed on the input rows
    ``rows[d]`` of a ``total``-row input) back into the caller's order."""
    first = results[0]
    flat = [r for part in rows for r in part]
    if isinstance(first, tuple):
        return tuple(gather([r[i] for r in results], rows, total) for i in range(len(first)))
    if isinstance(first, dict):
        return reduce_metrics(results)
    if isinstance(first, Batch):
        merged = cat_rollout_batches(results)
        return merged.index(_restore(flat, total, len(merged)))
    if isinstance(first, StepOutput):
        outputs = {k: torch.cat([r.outputs[k] for r in results]) for k in first.outputs}
        size = next(iter(outputs.values())).shape[0] if outputs else 0
        order = torch.tensor(_restore(flat, total, size), dtype=torch.long)
        return StepOutput(outputs={k: v[order] for k, v in outputs.items()}, metrics=dict(first.metrics))
    if isinstance(first, torch.Tensor) and first.dim() >= 1:
        merged_t = torch.cat(list(results))
        return merged_t[torch.tensor(_restore(flat, total, merged_t.shape[0]), dtype=torch.long)]
    if isinstance(first, list):
        merged_l = [x for r in results for x in r]
        return [merged_l[i] for i in _restore(flat, total, len(merged_l))]
    return first


def prompt_batch(prompt_ids: Sequence[Sequence[int]]) -> Batch:
    """The prompts of one generate call as a batch that ``Dispatch.DP`` can split: metadata
    ``prompt_ids`` and ``prompt_index`` (each prompt's index in the whole call, which keeps
    sampling placement-invariant, see :mod:`geartrain.seeding`)."""
    ids = [list(p) for p in prompt_ids]
    return Batch(meta={"prompt_ids": ids, "prompt_index": list(range(len(ids)))}, batch_size=len(ids))
