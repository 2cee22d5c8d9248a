"""Micro-batches without padding for megatron's schedules.

A batch row is ``[left pad | prompt | response | right pad]``. Rows are grouped under
the token budget (first-fit decreasing) and each group becomes one micro-batch of
*left-aligned* rows ``[b, L]`` (``L`` = its longest sequence): every sequence starts at
position 0, padding only trails, so a plain causal mask is exact (no token attends to
padding) and megatron's rotary positions (0..L-1) are the sequence's own positions.
Per-token results come back into the caller's ``[b, T]`` layout with
:meth:`MicroBatch.scatter` (the result for token ``t`` is computed at ``t - 1``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from geartrain.batch import Batch


@dataclass(kw_only=True, slots=True)
class MicroBatch:
    """One micro-batch. ``batch`` is ``None`` for a filler (a rank with no rows left runs
    one token so that the pipeline still has a micro-batch to schedule)."""

    batch: Batch | None
    rows: list[int]
    tokens: torch.Tensor
    """``[b, L]`` left-aligned token ids (0 after each sequence's end)."""
    targets: torch.Tensor
    """``[b, L]`` next token of each position (0 where undefined)."""
    src: tuple[torch.Tensor, torch.Tensor]
    """Positions ``(row, j)`` in ``tokens`` whose result is defined (``j + 1`` is real)."""
    dst: tuple[torch.Tensor, torch.Tensor]
    """Where those results go in the caller's ``[b, T]`` layout."""
    width: int
    num_rows: int

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def padded(self, rows: int, length: int) -> MicroBatch:
        """The same micro-batch with ``tokens``/``targets`` padded to ``[rows, length]``
        (trailing padding only: results of real tokens do not change)."""
        b, n = self.tokens.shape
        tokens = self.tokens.new_zeros(rows, length)
        tokens[:b, :n] = self.tokens
        targets = self.targets.new_zeros(rows, length)
        targets[:b, :n] = self.targets
        return MicroBatch(
            batch=self.batch,
            rows=self.rows,
            tokens=tokens,
            targets=targets,
            src=self.src,
            dst=self.dst,
            width=self.width,
            num_rows=self.num_rows,
        )

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """``[b, L]`` results at positions ``j`` -> ``[b, T]`` aligned to the caller's
        tokens (0 on first tokens and padding). Differentiable in ``values``."""
        out = values.new_zeros(self.num_rows, self.width)
        return out.index_put((self.dst[0].to(values.device), self.dst[1].to(values.device)), values[self.src])


def make_micro_batch(batch: Batch | None, rows: list[int], width: int) -> MicroBatch:
    """Left-align the rows of ``batch`` (``None``: a one-token filler)."""
    if batch is None:
        z = torch.zeros(1, 1, dtype=torch.long)
        empty = (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
        return MicroBatch(
            batch=None, rows=[], tokens=z, targets=z.clone(), src=empty, dst=empty, width=width, num_rows=0
        )
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    lengths = mask.sum(1)
    b, longest = ids.shape[0], max(int(lengths.max()), 1)
    tokens = torch.zeros(b, longest, dtype=ids.dtype)
    targets = torch.zeros_like(tokens)
    src_r, src_j, dst_c = [], [], []
    for r in range(b):
        cols = mask[r].nonzero().squeeze(1)
        n = cols.numel()
        tokens[r, :n] = ids[r, cols]
        targets[r, : max(n - 1, 0)] = ids[r, cols[1:]]
        src_r += [r] * max(n - 1, 0)
        src_j += list(range(max(n - 1, 0)))
        dst_c += cols[1:].tolist()
    src = (torch.tensor(src_r, dtype=torch.long), torch.tensor(src_j, dtype=torch.long))
    dst = (src[0], torch.tensor(dst_c, dtype=torch.long))
    return MicroBatch(batch=batch, rows=rows, tokens=tokens, targets=targets, src=src, dst=dst, width=width, num_rows=b)
