"""GPU kernels for the packed and shared-prompt attention: flash-attn's varlen kernels when
flash-attn is installed, else ``torch.nn.attention.flex_attention`` under a block mask;
never a dense ``N x N`` boolean mask.

Both kernels see the micro-batch through *token labels* built once per forward:

* packed sequences (:mod:`geartrain_fsdp.packing`): ``cu_seqlens``; a token attends to the
  tokens of its own sequence causally (document masking);
* shared prompts (:mod:`geartrain_fsdp.prefix_sharing`): per token its segment and its
  response (0 for the prompt); a token attends causally within its segment to the prompt
  and to its own response (prefix masking).

flash-attn expresses the shared-prompt mask as a varlen call with separate query and key
sequences: one query sequence for each prompt (its keys: the prompt) and one per response
(its keys: the prompt followed by the response, gathered), causal aligned bottom-right, so
response token ``i`` sees the prompt and its response up to ``i``. The queries are the
packed row in order, so outputs need no permutation; gathering the prompt's keys once per
response costs ``n * p`` key/value rows, not ``N^2`` mask entries.

On CPU the engine keeps its SDPA path (``attention = "auto"``): flex_attention runs there
forward-only (torch 2.13 has no CPU backward for it) and flash-attn not at all. The label
and layout construction is plain tensor code, tested on CPU against SDPA
(:func:`varlen_reference` runs the flash layout through SDPA).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

__all__ = [
    "AttentionKernel",
    "KernelChoice",
    "TokenLabels",
    "VarlenLayout",
    "choose_kernel",
    "flash_available",
    "flash_varlen",
    "flex_attention_call",
    "flex_block_mask",
    "packed_labels",
    "shared_labels",
    "varlen_layout",
    "varlen_reference",
]

AttentionKernel = Literal["sdpa", "flex", "flash"]
KernelChoice = Literal["auto", "sdpa", "flex", "flash"]


def flash_available() -> bool:
    """flash-attn (2.x ``flash_attn`` or 4.x ``flash_attn.cute``) can be imported."""
    return _flash_function() is not None


def choose_kernel(
    choice: KernelChoice, device: torch.device, compute_dtype: torch.dtype = torch.bfloat16
) -> AttentionKernel:
    """The kernel for ``options.attention = choice`` on ``device`` computing in
    ``compute_dtype``: ``auto`` is flash-attn on CUDA when installed and the compute is
    bf16/fp16 (its only dtypes), else flex_attention on CUDA, else SDPA (CPU). An explicit
    ``flash`` without the package, or in fp32, is an error that says what to change."""
    half = compute_dtype in (torch.bfloat16, torch.float16)
    if choice == "auto":
        if device.type != "cuda":
            return "sdpa"
        return "flash" if half and flash_available() else "flex"
    if choice == "flash" and not flash_available():
        raise ValueError(
            "options.attention = 'flash' needs flash-attn: pip install './plugins/fsdp_engine[flash-attn]' "
            "(or set attention = 'flex' / 'auto')"
        )
    if choice == "flash" and not half:
        raise ValueError(
            f"options.attention = 'flash' computes in bfloat16/float16 only, the engine in {compute_dtype}: "
            "set param_dtype = 'bfloat16' (or attention = 'flex' / 'auto')"
        )
    return choice


# --------------------------------------------------------------------------- token labels
@dataclass(frozen=True, slots=True)
class TokenLabels:
    """Per packed token: ``doc`` (its sequence or segment), ``part`` (0: a plain sequence's
    token or a shared prompt's; ``r > 0``: response ``r`` of its segment). A query sees a
    key when both are in one ``doc``, the key is not later, and the key's part is 0 or the
    query's own."""

    doc: torch.Tensor
    part: torch.Tensor

    def allowed(self) -> torch.Tensor:
        """The dense ``[N, N]`` mask these labels describe: for tests only, never on GPU."""
        n = self.doc.numel()
        q = torch.arange(n, device=self.doc.device)
        causal = q[:, None] >= q[None, :]
        same = self.doc[:, None] == self.doc[None, :]
        visible = (self.part[None, :] == 0) | (self.part[None, :] == self.part[:, None])
        return causal & same & visible


def packed_labels(cu_seqlens: Sequence[int], device: torch.device | str = "cpu") -> TokenLabels:
    """Labels of a packed row of plain sequences with boundaries ``cu_seqlens``."""
    lengths = torch.tensor([e - s for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)])
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)
    return TokenLabels(doc=doc, part=torch.zeros_like(doc))


def shared_labels(segments: Sequence[Any], device: torch.device | str = "cpu") -> TokenLabels:
    """Labels of a shared-prompt row (:class:`~geartrain_fsdp.prefix_sharing.Segment` s in
    packed order: ``start``, ``prefix``, ``responses``)."""
    doc: list[int] = []
    part: list[int] = []
    for i, seg in enumerate(segments):
        doc += [i] * seg.length
        part += [0] * seg.prefix
        for r, q in enumerate(seg.responses, start=1):
            part += [r] * q
    return TokenLabels(doc=torch.tensor(doc, device=device), part=torch.tensor(part, device=device))


# --------------------------------------------------------------------------- flex_attention
def flex_block_mask(labels: TokenLabels, *, block_size: int = 128) -> Any:
    """The :class:`~torch.nn.attention.flex_attention.BlockMask` of ``labels``, built from
    per-block label ranges (``O((N / block)^2)`` work, no ``N x N`` mask, no compilation):
    a block pair is skipped when no query of it can see a key (the key block lies after the
    query block, in other documents, or only in responses other than the queries'), run
    without the mask function when every query sees every key (below the diagonal, one
    document, the keys all prompt or all the queries' own response), and with it otherwise."""
    from torch.nn.attention.flex_attention import BlockMask

    doc, part = labels.doc, labels.part
    n = doc.numel()
    blocks = -(-n // block_size)
    pad = blocks * block_size - n

    def ranges(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lo = torch.cat([x, x[-1:].expand(pad)]).view(blocks, block_size)
        return lo.min(1).values, lo.max(1).values

    dmin, dmax = ranges(doc)
    pmin, pmax = ranges(part)
    idx = torch.arange(blocks, device=doc.device)
    q, k = idx[:, None], idx[None, :]
    causal = k <= q
    docs_meet = (dmin[k] <= dmax[q]) & (dmax[k] >= dmin[q])
    parts_meet = (pmin[k] == 0) | ((pmin[k] <= pmax[q]) & (pmax[k] >= pmin[q]))
    any_seen = causal & docs_meet & parts_meet
    complete = torch.ones(blocks, dtype=torch.bool, device=doc.device)
    complete[-1] = pad == 0
    one_doc = (dmin == dmax)[:, None] & (dmin == dmax)[None, :] & (dmin[q] == dmin[k])
    one_part = (pmin == pmax)[:, None] & (pmin == pmax)[None, :] & (pmin[q] == pmin[k])
    full = (k < q) & one_doc & ((pmax[k] == 0) | one_part) & complete[:, None] & complete[None, :]
    partial = any_seen & ~full

    def as_kv(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = matrix.sum(-1).to(torch.int32)
        order = torch.argsort((~matrix).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return count[None, None], order[None, None]

    # the kernels call mask_mod on whole blocks: labels padded to them (padding: document -1)
    doc_p = torch.cat([doc, doc.new_full((pad,), -1)])
    part_p = torch.cat([part, part.new_zeros(pad)])

    def mask_mod(b: Any, h: Any, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (doc_p[q] == doc_p[kv]) & (kv <= q) & ((part_p[kv] == 0) | (part_p[kv] == part_p[q]))

    kv_num, kv_idx = as_kv(partial)
    full_num, full_idx = as_kv(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(n, n)
    )


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def flex_attention_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any, scaling: float | None
) -> torch.Tensor:
    """flex_attention of ``[1, H, N, d]`` tensors (``k``/``v`` may have fewer heads) under
    ``block_mask``; compiled on CUDA (the eager version materialises scores), eager on CPU
    (forward only there)."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = _compiled_flex() if q.device.type == "cuda" else flex_attention
    return fn(q, k, v, block_mask=block_mask, scale=scaling, enable_gqa=k.shape[1] != q.shape[1])


# --------------------------------------------------------------------------- flash-attn varlen
@dataclass(frozen=True, slots=True)
class VarlenLayout:
    """A varlen call: query sequences are consecutive runs of the packed row
    (``cu_q``); key sequence ``i`` is ``key_index[cu_k[i]:cu_k[i+1]]`` (packed positions);
    causal masking is aligned bottom-right (the last query sees the last key).
    ``key_index`` is None when the keys are the packed row itself (``cu_k == cu_q``)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    key_index: torch.Tensor | None


def varlen_layout(
    *,
    cu_seqlens: Sequence[int] | None = None,
    segments: Sequence[Any] | None = None,
    device: torch.device | str = "cpu",
) -> VarlenLayout:
    """The varlen layout of a packed row of plain sequences (``cu_seqlens``) or of a
    shared-prompt row (``segments``)."""
    if (cu_seqlens is None) == (segments is None):
        raise ValueError("give exactly one of cu_seqlens and segments")
    if cu_seqlens is not None:
        cu = torch.tensor(list(cu_seqlens), dtype=torch.int32)
        longest = int(cu.diff().max()) if len(cu) > 1 else 0
        cu = cu.to(device)
        return VarlenLayout(cu_q=cu, cu_k=cu, max_q=longest, max_k=longest, key_index=None)
    q_lens: list[int] = []
    k_lens: list[int] = []
    keys: list[torch.Tensor] = []
    assert segments is not None
    for seg in segments:
        prompt = torch.arange(seg.start, seg.start + seg.prefix)
        q_lens.append(seg.prefix)
        k_lens.append(seg.prefix)
        keys.append(prompt)
        block = seg.start + seg.prefix
        for q in seg.responses:
            if q:
                q_lens.append(q)
                k_lens.append(seg.prefix + q)
                keys += [prompt, torch.arange(block, block + q)]
            block += q

    def cumulative(lengths: list[int]) -> torch.Tensor:
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
        return cu.to(device)

    return VarlenLayout(
        cu_q=cumulative(q_lens),
        cu_k=cumulative(k_lens),
        max_q=max(q_lens, default=0),
        max_k=max(k_lens, default=0),
        key_index=torch.cat(keys).to(device),
    )


@functools.cache
def _flash_function() -> tuple[str, Callable[..., Any]] | None:
    try:  # flash-attn 4 (CuTe DSL; Hopper / Blackwell)
        from flash_attn.cute import flash_attn_varlen_func

        return "fa4", flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - any import failure means "not this one"
        pass
    try:
        from flash_attn import flash_attn_varlen_func

        return "fa2", flash_attn_varlen_func
    except Exception:  # noqa: BLE001
        return None


VarlenFn = Callable[..., torch.Tensor]


def varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    softmax_scale: float | None,
    causal: bool,
) -> torch.Tensor:
    """flash-attn's varlen contract (``[T, H, d]`` tensors, bottom-right causal) computed
    with SDPA one sequence at a time: the CPU stand-in the layout is tested with."""
    outs = []
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        qi, ki, vi = (x.transpose(0, 1).unsqueeze(0) for x in (q[qs:qe], k[ks:ke], v[ks:ke]))
        rows, cols = torch.arange(qe - qs)[:, None], torch.arange(ke - ks)[None, :]
        mask = (cols <= rows + (ke - ks) - (qe - qs)).to(q.device) if causal else None
        out = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, scale=softmax_scale, enable_gqa=ki.shape[1] != qi.shape[1]
        )
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


def flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: VarlenLayout,
    scaling: float | None,
    kernel: VarlenFn | None = None,
) -> torch.Tensor:
    """Attention of ``[1, H, N, d]`` tensors under ``layout``; returns ``[1, H, N, d]``.
    ``kernel`` defaults to the installed flash-attn (tests pass :func:`varlen_reference`)."""
    qt, kt, vt = (x[0].transpose(0, 1) for x in (q, k, v))  # [N, h, d]
    if layout.key_index is not None:
        kt, vt = kt.index_select(0, layout.key_index), vt.index_select(0, layout.key_index)
    if kernel is None:
        found = _flash_function()
        if found is None:
            raise RuntimeError("flash-attn is not installed: pip install './plugins/fsdp_engine[flash-attn]'")
        kind, fn = found
        if kind == "fa4":

            def kernel(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):  # type: ignore[no-untyped-def]
                out = fn(
                    q,
                    k,
                    v,
                    cu_seqlens_q=cu_q,
                    cu_seqlens_k=cu_k,
                    max_seqlen_q=max_q,
                    max_seqlen_k=max_k,
                    softmax_scale=softmax_scale,
                    causal=causal,
                )
                return out[0] if isinstance(out, tuple) else out

        else:
            kernel = fn
    out = kernel(
        qt.contiguous(),
        kt.contiguous(),
        vt.contiguous(),
        layout.cu_q,
        layout.cu_k,
        layout.max_q,
        layout.max_k,
        softmax_scale=scaling,
        causal=True,
    )
    return out.transpose(0, 1).unsqueeze(0)
