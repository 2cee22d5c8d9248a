"""Packed (variable-length) attention and Ulysses sequence parallelism for transformers
models, through transformers' attention-function registry.

The engine sets ``config._attn_implementation = ATTENTION_NAME`` on packed runs. Every
attention layer then calls :func:`packed_attention` with its local ``[1, heads, n, d]``
query/key/value. Outside sequence parallelism it runs causal SDPA per sequence
(``cu_seqlens``; sequences of one length batched into one call), so no token attends
across a sequence boundary. With ``sp > 1`` each rank holds ``n = N / sp`` consecutive
tokens of the packed row; an all-to-all trades heads for sequence (each rank gets
``heads / sp`` heads over all ``N`` tokens), attention runs per sequence, and a second
all-to-all trades back. KV heads that ``sp`` does not divide
are repeated first (as GQA would) so each rank gets whole KV groups.

No mask function is registered for the name, so transformers builds no ``N x N`` mask.
On CUDA the per-sequence (or per-segment) attention runs on flash-attn's varlen kernels
or flex_attention instead of SDPA (:mod:`geartrain_fsdp.attention_kernels`).
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

from geartrain_fsdp.attention_kernels import (
    AttentionKernel,
    VarlenLayout,
    flash_varlen,
    flex_attention_call,
    flex_block_mask,
    packed_labels,
    shared_labels,
    varlen_layout,
)
from geartrain_fsdp.prefix_sharing import Segment, SegmentAttention, segment_attention

ATTENTION_NAME = "geartrain_packed"


@dataclass(kw_only=True, slots=True)
class PackedAttentionState:
    """What attention needs to know about the current packed forward."""

    cu_seqlens: list[int]
    """Boundaries of the sequences in the full packed row (length ``N``)."""
    sp_group: Any = None
    sp_size: int = 1
    groups: LengthGroups | None = None
    """The sequences grouped by length; built by the first attention layer of the
    forward, reused by the others."""
    segments: list[Segment] | None = None
    """Set for a shared-prompt micro-batch (:mod:`geartrain_fsdp.prefix_sharing`, sp = 1):
    attention runs under its segment mask instead of per sequence."""
    kernel: AttentionKernel = "sdpa"
    """Which kernel runs attention (:func:`~geartrain_fsdp.attention_kernels.choose_kernel`)."""
    shared: SegmentAttention | None = None
    """SDPA's bucketed segment masks, built from ``segments`` by the first layer."""
    block_mask: Any = None
    """flex_attention's block mask, built by the first layer."""
    varlen: VarlenLayout | None = None
    """flash-attn's varlen layout, built by the first layer."""


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


@dataclass(kw_only=True, slots=True)
class LengthGroups:
    """The packed row's sequences grouped by length: ``order`` ``[N]`` lists the packed
    token indices group by group (shortest length first, sequences in packed order),
    ``inverse`` ``[N]`` puts them back, ``groups`` holds ``(length, count)`` per group."""

    order: torch.Tensor
    inverse: torch.Tensor
    groups: list[tuple[int, int]]

    @classmethod
    def build(cls, cu_seqlens: list[int], device: torch.device) -> LengthGroups:
        by_length: dict[int, list[int]] = {}
        for i, (s, e) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)):
            by_length.setdefault(e - s, []).append(i)
        spans, groups = [], []
        for length in sorted(by_length):
            spans += [torch.arange(cu_seqlens[i], cu_seqlens[i + 1]) for i in by_length[length]]
            groups.append((length, len(by_length[length])))
        order = torch.cat(spans)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        return cls(order=order.to(device), inverse=inverse.to(device), groups=groups)


def grouped_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: LengthGroups, scaling: float | None
) -> torch.Tensor:
    """:func:`varlen_causal_attention` with one batched SDPA call per distinct sequence
    length: the sequences of a group are gathered into ``[count, h, length, d]`` rows."""
    gqa = k.shape[1] != q.shape[1]
    sizes = [length * count for length, count in layout.groups]
    parts = zip(*(x.index_select(2, layout.order).split(sizes, dim=2) for x in (q, k, v)), strict=True)
    outs = []
    for (length, count), (qi, ki, vi) in zip(layout.groups, parts, strict=True):

        def rows(x: torch.Tensor, count: int = count, length: int = length) -> torch.Tensor:
            return x[0].reshape(x.shape[1], count, length, x.shape[3]).transpose(0, 1)

        out = F.scaled_dot_product_attention(
            rows(qi), rows(ki), rows(vi), is_causal=True, scale=scaling, enable_gqa=gqa
        )
        outs.append(out.transpose(0, 1).reshape(1, q.shape[1], length * count, q.shape[3]))
    return torch.cat(outs, dim=2).index_select(2, layout.inverse)


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: list[int],
    scaling: float | None,
    state: PackedAttentionState | None = None,
) -> torch.Tensor:
    """Causal attention inside each ``[cu[i], cu[i+1])`` segment of ``[1, H, N, d]``
    tensors (``k``/``v`` may have fewer heads: grouped-query).

    Segments of one common length run as one batched SDPA call; with several lengths,
    one batched call per length (:func:`grouped_causal_attention`; the grouping is built
    once per forward in ``state``): many short sequences then cost a few calls, not one
    each. A sequence's numbers do not depend on which other sequences share its
    micro-batch (batching rows of one length leaves each row's results bitwise unchanged)."""
    gqa = k.shape[1] != q.shape[1]  # SDPA maps query-head groups onto KV heads itself
    lengths = [e - s for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)]
    distinct = len(set(lengths))
    if 1 < distinct < len(lengths):
        layout = state.groups if state is not None else None
        if layout is None:
            layout = LengthGroups.build(cu_seqlens, q.device)
            if state is not None:
                state.groups = layout
        return grouped_causal_attention(q, k, v, layout, scaling)
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
    if state.segments is not None and state.kernel == "sdpa":
        if state.shared is None:
            state.shared = SegmentAttention.build(state.segments, query.device)
        return segment_attention(query, key, value, state.shared, scaling).transpose(1, 2).contiguous(), None
    sp = state.sp_size
    if sp > 1:
        reps = kv_repeats_for(query.shape[1], key.shape[1], sp)
        if reps > 1:
            key = key.repeat_interleave(reps, dim=1)
            value = value.repeat_interleave(reps, dim=1)
        query = heads_to_sequence(query, state.sp_group, sp)
        key = heads_to_sequence(key, state.sp_group, sp)
        value = heads_to_sequence(value, state.sp_group, sp)
    out = _attend(query, key, value, state, scaling)
    if sp > 1:
        out = sequence_to_heads(out, state.sp_group, sp)
    return out.transpose(1, 2).contiguous(), None


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, state: PackedAttentionState, scaling: float | None
) -> torch.Tensor:
    """``[1, H, N, d]`` attention over the whole packed row with the state's kernel; the
    kernel's layout (block mask, varlen offsets) is built by the first layer, reused by the rest."""
    if state.kernel == "sdpa":
        return varlen_causal_attention(query, key, value, state.cu_seqlens, scaling, state)
    if state.kernel == "flex":
        if state.block_mask is None:
            labels = (
                shared_labels(state.segments, query.device)
                if state.segments is not None
                else packed_labels(state.cu_seqlens, query.device)
            )
            state.block_mask = flex_block_mask(labels)
        return flex_attention_call(query, key, value, state.block_mask, scaling)
    if state.varlen is None:
        if state.segments is not None:
            state.varlen = varlen_layout(segments=state.segments, device=query.device)
        else:
            state.varlen = varlen_layout(cu_seqlens=state.cu_seqlens, device=query.device)
    return flash_varlen(query, key, value, state.varlen, scaling)


@torch.compiler.disable
def _opaque_packed_attention(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """:func:`packed_attention` as registered: opaque to torch.compile (``options.compile``,
    :mod:`geartrain_fsdp.compiling`), since it plans its work from the per-forward state's
    Python lists, which a compiled graph would specialise on. Its output is never a view:
    whether it is one depends on the attention path (SDPA's output layout, the number of
    distinct lengths), and dynamo guards on a view's base, so a view would recompile the
    layer's second graph when the path changes."""
    out, weights = packed_attention(*args, **kwargs)
    return (out if out._base is None else out.clone()), weights


AttentionInterface.register(ATTENTION_NAME, _opaque_packed_attention)


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
    "LengthGroups",
    "gather_sequence",
    "kv_repeats_for",
    "local_slice",
    "packed_attention",
    "packed_attention_state",
    "grouped_causal_attention",
    "varlen_causal_attention",
]
