"""Torch versions of the few ``sgl_kernel`` CPU ops SGLang's CPU path calls.

Registered under SGLang's names (``torch.ops.sgl_kernel.<op>``) when the ``sgl_kernel``
placeholder of :mod:`geartrain_sglang.cpu_shims` is imported, i.e. only where the compiled
package is missing. Each computes what the compiled op computes.
"""

from __future__ import annotations

import torch

_MASK = 0xFFFFFFFF
_library: torch.library.Library | None = None


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _MASK


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # int64 products wrap, which keeps the low 32 bits exact
    k = (k * 0xCC9E2D51) & _MASK
    k = _rotl32(k, 15)
    k = (k * 0x1B873593) & _MASK
    h = h ^ k
    h = _rotl32(h, 13)
    return (h * 5 + 0xE6546B64) & _MASK


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK
    return h ^ (h >> 16)


def murmur_hash32(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """``[n, m]`` MurmurHash3 (32-bit) of (seed, position, column) per row ``n`` and column
    ``m``, as SGLang's ``murmur_hash32`` kernel: the random bits of its seeded sampler."""
    seed = seed.to(torch.int64)
    low = (seed & _MASK)[:, None]
    high = ((seed >> 32) & _MASK)[:, None]
    pos = (positions.to(torch.int64) & _MASK)[:, None]
    col = (col_indices.to(torch.int64) & _MASK)[None, :]
    h = torch.zeros_like(low)
    for block in (low, high, pos):
        h = _mix(h, block)
    h = _mix(h.expand(-1, col.shape[1]), col.expand(h.shape[0], -1))
    return _fmix32(h ^ 16)


def register() -> None:
    """Define ``torch.ops.sgl_kernel.murmur_hash32_cpu`` (idempotent)."""
    global _library
    if _library is not None or hasattr(torch.ops.sgl_kernel, "murmur_hash32_cpu"):
        return
    _library = torch.library.Library("sgl_kernel", "FRAGMENT")
    _library.define("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")
    _library.impl("murmur_hash32_cpu", murmur_hash32, "CPU")
