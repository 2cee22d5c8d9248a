"""Packed (variable-length) attention and Ulysses sequence parallelism for transformers
models, through transformers' attention-function registry.

The engine sets ``config._attn_implementation = ATTENTION_NAME`` on packed runs. Every
attention layer then calls :func:`packed_attention` with its local ``[1, heads, n, d]``
query/key/value. Outside sequence parallelism it runs causal SDPA per sequence
(``cu_seqlens``), so no token attends across a sequence boundary. With ``sp > 1`` each
rank holds ``n = N / sp`` consecutive tokens of the packed row; an all-to-all trades heads
for sequence (each rank gets ``heads / sp`` heads over all ``N`` tokens), attention runs
per sequence, and a second all-to-all trades back. KV heads that ``sp`` does not divide
are repeated first (as GQA would) so each rank gets whole KV groups.

No mask function is registered for the name, so transformers builds no ``N x N`` mask.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "geartrain_packed"


@dataclass(kw_only=True, slots=True)
class PackedAttentionState:
    """What attention needs to know about the current packed forward."""

    cu_seqlens: list[int]
    """Boundaries of the sequences in the full packed row (length ``N``)."""
    sp_group: Any = None
    sp_size: int = 1


_local = threading.local()


@contextlib.contextmanager
def packed_attention_state(state: PackedAttentionState) -> Iterator[None]:
    """Make ``state`` visible to :func:`packed_attention` during one forward (and the
    backward recomputation of gradient checkpointing, which runs inside the same step)."""
    previous = getattr(_local, "state", None)
    _local.state = state
    try:
        yield
    finally:
        _local.state = previous


def current_state() -> PackedAttentionState:
    state = getattr(_local, "state", None)
    if state is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' called outside a packed forward of the fsdp engine")
    return state


class _AllToAll(torch.autograd.Function):
    """``x`` ``[sp, ...]``: chunk ``i`` goes to rank ``i``; returns ``[sp, ...]`` with chunk
    ``i`` from rank ``i``. Its own inverse, so backward is the same exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def heads_to_sequence(x: torch.Tensor, group: Any, sp: int) -> torch.Tensor:
    """``[1, H, n, d]`` (all heads, local tokens) -> ``[1, H / sp, sp * n, d]``."""
    _, h, n, d = x.shape
    y = _AllToAll.apply(x.reshape(sp, h // sp, n, d), group)  # [src rank, H/sp, n, d]
    return y.permute(1, 0, 2, 3).reshape(1, h // sp, sp * n, d)


def sequence_to_heads(x: torch.Tensor, group: Any, sp: int) -> torch.Tensor:
    """Inverse of :func:`heads_to_sequence`: ``[1, H / sp, N, d]`` -> ``[1, H, N / sp, d]``."""
    _, hl, big_n, d = x.shape
    n = big_n // sp
    y = x.reshape(hl, sp, n, d).permute(1, 0, 2, 3).contiguous()
    y = _AllToAll.apply(y, group)  # [src rank = head group, H/sp, n, d]
    return y.reshape(1, sp * hl, n, d)


def kv_repeats_for(num_heads: int, num_kv_heads: int, sp: int) -> int:
    """How often to repeat each KV head so that ``sp`` divides the KV heads while every
    query-head group still maps onto whole KV heads."""
    if num_heads % sp:
        raise ValueError(f"sequence parallel size {sp} must divide the {num_heads} attention heads")
    for r in range(1, num_heads // num_kv_heads + 1):
        kv = num_kv_heads * r
        if kv % sp == 0 and num_heads % kv == 0:
            return r
    return num_heads // num_kv_heads


def varlen_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int], scaling: float | None
) -> torch.Tensor:
    """Causal attention inside each ``[cu[i], cu[i+1])`` segment of ``[1, H, N, d]``
    tensors (``k``/``v`` may have fewer heads: grouped-query).

    One SDPA call per segment: a sequence's numbers then do not depend on which other
    sequences share its micro-batch (micro-batching leaves results bitwise unchanged).
    Segments of one common length run as a single batched call."""
    gqa = k.shape[1] != q.shape[1]  # SDPA maps query-head groups onto KV heads itself
    lengths = [e - s for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)]
    if len(set(lengths)) == 1:  # equal lengths: the rows are a view of the packed row
        length, d = lengths[0], q.shape[3]

        def rows(x: torch.Tensor) -> torch.Tensor:  # [1, h, N, d] -> [S, h, L, d]
            return x[0].reshape(x.shape[1], -1, length, d).transpose(0, 1)

        out = F.scaled_dot_product_attention(rows(q), rows(k), rows(v), is_causal=True, scale=scaling, enable_gqa=gqa)
        return out.transpose(0, 1).reshape(1, q.shape[1], -1, d)
    # split (not slicing): its backward is one concatenation, not a zero-filled full-size
    # gradient per segment
    parts = zip(q.split(lengths, dim=2), k.split(lengths, dim=2), v.split(lengths, dim=2), strict=True)
    outs = [
        F.scaled_dot_product_attention(
            qi.contiguous(), ki.contiguous(), vi.contiguous(), is_causal=True, scale=scaling, enable_gqa=gqa
        )
        for qi, ki, vi in parts
    ]
    return torch.cat(outs, dim=2)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (``[1, heads, n, d]`` in, ``[1, n, heads, d]`` out)."""
    state = current_state()
    if dropout and module.training:
        raise ValueError("the fsdp engine's packed attention does not implement attention dropout")
    sp = state.sp_size
    if sp > 1:
        reps = kv_repeats_for(query.shape[1], key.shape[1], sp)
        if reps > 1:
            key = key.repeat_interleave(reps, dim=1)
            value = value.repeat_interleave(reps, dim=1)
        query = heads_to_sequence(query, state.sp_group, sp)
        key = heads_to_sequence(key, state.sp_group, sp)
        value = heads_to_sequence(value, state.sp_group, sp)
    out = varlen_causal_attention(query, key, value, state.cu_seqlens, scaling)
    if sp > 1:
        out = sequence_to_heads(out, state.sp_group, sp)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, packed_attention)


class _GatherSequence(torch.autograd.Function):
    """All-gather ``[n, ...]`` chunks of the sp group into ``[sp * n, ...]``. Every rank then
    computes the same loss on the gathered tensor, so backward keeps only the local
    chunk's gradient (no sum): the ranks' parameter gradients add up to the full one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, sp: int, rank: int) -> torch.Tensor:
        ctx.rank, ctx.n = rank, x.shape[0]
        x = x.contiguous()
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(sp)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n], None, None, None


def gather_sequence(x: torch.Tensor, group: Any, sp: int, rank: int) -> torch.Tensor:
    """Concatenate the sp ranks' local chunks (dim 0) in rank order."""
    if sp == 1:
        return x
    return _GatherSequence.apply(x, group, sp, rank)


def local_slice(length: int, sp: int, rank: int) -> slice:
    """The consecutive tokens of a packed row of ``length`` (a multiple of ``sp``) that
    sequence-parallel rank ``rank`` computes."""
    n = length // sp
    return slice(rank * n, (rank + 1) * n)


__all__ = [
    "ATTENTION_NAME",
    "PackedAttentionState",
    "gather_sequence",
    "kv_repeats_for",
    "local_slice",
    "packed_attention",
    "packed_attention_state",
    "varlen_causal_attention",
]
