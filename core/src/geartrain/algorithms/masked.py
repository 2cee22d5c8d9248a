"""Reductions over the positions a mask selects.

Masks are ``0/1`` tensors of the same shape as the values (or broadcastable to it). Values at
masked-out positions never reach a result, even when they are ``inf`` or ``nan``.
"""

from __future__ import annotations

import torch


def zero_outside(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` with masked-out positions set to 0 (so nan/inf there cannot leak)."""
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def finite_inputs(mask: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` with masked-out positions set to 0, so junk there (``-inf`` log-probs of
    padding) gives neither a nan loss nor a nan gradient."""
    return tuple(zero_outside(t, mask) for t in tensors)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1 (over ``dim``, or everything)."""
    kept = zero_outside(values, mask)
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1; 0 where the mask selects nothing."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = True) -> torch.Tensor:
    """Variance over all masked positions: unbiased (``/(N - 1)``, 0 when fewer than two),
    or with ``unbiased=False`` the biased ``/N`` one (verl's ``masked_var(unbiased=...)``)."""
    count = mask.to(values.dtype).sum()
    mean = masked_mean(values, mask)
    squares = masked_sum((values - mean) ** 2, mask)
    if not unbiased:
        return squares / count.clamp(min=1)
    return squares / (count - 1) if count > 1 else torch.zeros_like(mean)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, unbiased: bool = True
) -> torch.Tensor:
    """``(values - mean) * rsqrt(var + 1e-8)`` with the masked mean and the (by default
    unbiased, verl's convention) variance of the whole tensor. ``shift_mean=False`` adds the
    mean back; ``unbiased=False`` divides the variance by ``N`` instead of ``N - 1``.

    Positions outside the mask are transformed too; multiply by the mask if they must be 0.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=unbiased)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean
