"""Dynamic micro-batches and padding removal.

A batch row is ``[left pad | prompt | response | right pad]``; its real tokens are where
``attention_mask`` is 1. :func:`~geartrain.micro_batches.plan_micro_batches` (the core's)
groups rows under a token budget; :func:`pack` concatenates a micro-batch's real tokens into
one row with ``position_ids`` restarting at 0 for every sequence (and ``cu_seqlens`` marking
the boundaries), and :func:`scatter_shifted` puts per-token results back into the ``[b, T]``
layout of :mod:`geartrain.types` (result for token ``t`` comes from the hidden state at
``t - 1``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True, slots=True)
class Packed:
    """One micro-batch with its padding removed.

    ``input_ids``/``position_ids`` are ``[1, N]`` (``N`` = real tokens plus ``pad`` filler
    tokens at the end, so that ``N`` divides by the sequence-parallel size);
    ``cu_seqlens`` ``[S + 1]`` are the sequence boundaries (the filler is one more
    sequence); ``targets[j]`` is token ``j + 1`` and ``valid[j]`` says it belongs to the same
    sequence as ``j``; ``flat_index`` maps real token ``j`` to its place in the flattened
    ``[b, T]`` layout."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    targets: torch.Tensor
    valid: torch.Tensor
    flat_index: torch.Tensor
    num_tokens: int
    pad: int
    shape: tuple[int, int]


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, multiple: int = 1) -> Packed:
    """Remove the padding of ``[b, T]`` rows: one ``[1, N]`` row of their real tokens."""
    b, t = input_ids.shape
    mask = attention_mask.bool()
    flat_index = mask.flatten().nonzero().squeeze(1)
    ids = input_ids.flatten()[flat_index]
    lengths = mask.sum(1)
    lengths = lengths[lengths > 0]
    n = int(ids.numel())
    pad = (-n) % multiple
    if n == 0 and pad == 0:
        pad = multiple  # an empty micro-batch still runs one (filler) token per rank
    seq_lens = lengths.tolist() + ([pad] if pad else [])
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int64), 0)
    position_ids = (
        torch.cat([torch.arange(s, dtype=torch.int64) for s in seq_lens])
        if seq_lens
        else torch.zeros(0, dtype=torch.int64)
    )
    seq_id = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens, dtype=torch.int64))
    all_ids = torch.cat([ids, ids.new_zeros(pad)])
    targets = torch.cat([all_ids[1:], all_ids.new_zeros(1)])
    valid = torch.zeros_like(all_ids, dtype=torch.bool)
    valid[:-1] = seq_id[1:] == seq_id[:-1]
    valid[n:] = False
    return Packed(
        input_ids=all_ids.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        cu_seqlens=cu,
        targets=targets,
        valid=valid,
        flat_index=flat_index,
        num_tokens=n,
        pad=pad,
        shape=(b, t),
    )


def scatter_shifted(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Per-token results computed at packed position ``j`` (about token ``j + 1``) into
    the ``[b, T]`` layout: ``out[token j + 1] = values[j]``; the first token of each
    sequence and padding hold 0. Differentiable in ``values``."""
    n = packed.num_tokens
    b, t = packed.shape
    if n == 0:
        return values.new_zeros(b, t)
    kept = torch.where(packed.valid[: n - 1].to(values.device), values[: n - 1], values.new_zeros(()))
    shifted = torch.cat([values.new_zeros(1), kept])
    out = values.new_zeros(b * t)
    out = out.index_copy(0, packed.flat_index.to(values.device), shifted)
    return out.view(b, t)


def padded_inputs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, slice]:
    """For the padded path: the column range that holds real tokens, position ids counted
    over real tokens, and next-token targets. Returns ``(ids, mask, position_ids, cols)``."""
    mask = attention_mask.bool()
    cols_any = mask.any(0).nonzero().squeeze(1)
    cols = slice(int(cols_any[0]), int(cols_any[-1]) + 1) if cols_any.numel() else slice(0, 1)
    ids, m = input_ids[:, cols], attention_mask[:, cols]
    position_ids = (m.long().cumsum(1) - 1).clamp(min=0)
    return ids, m, position_ids, cols


def shift_padded(values: torch.Tensor, mask: torch.Tensor, cols: slice, full_width: int) -> torch.Tensor:
    """Padded-path results ``[b, w]`` computed at column ``c`` (about token ``c + 1``) into
    ``[b, T]``: shifted one column right, zero where the token or its predecessor is padding."""
    b, w = values.shape
    m = mask.bool()
    keep = m[:, 1:] & m[:, :-1]
    shifted = torch.where(keep.to(values.device), values[:, :-1], values.new_zeros(()))
    shifted = torch.cat([values.new_zeros(b, 1), shifted], dim=1)
    left = values.new_zeros(b, cols.start)
    right = values.new_zeros(b, full_width - cols.stop)
    return torch.cat([left, shifted, right], dim=1)
