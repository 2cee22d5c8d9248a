"""Turning a per-token loss matrix into a scalar (``loss_agg_mode``), globally normalised.

With ``global_tokens`` / ``global_sequences`` (from :class:`geartrain.types.LossContext`),
:func:`aggregate` returns this micro-batch's *share*: summed over all micro-batches and
data-parallel ranks of a step, the shares equal the loss of the unsplit batch. Without
them it normalises by the micro-batch's own counts (the loss of this batch alone).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

AggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = get_args(AggMode)


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: AggMode | str = "token-mean",
    *,
    global_tokens: int | float | torch.Tensor | None = None,
    global_sequences: int | float | torch.Tensor | None = None,
    norm_length: int | float | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat [B, T]`` over ``mask [B, T]`` into a scalar (differentiable).

    Modes (verl's ``loss_agg_mode``):

    * ``token-mean``: sum over masked tokens / ``global_tokens`` (default: masked tokens here).
    * ``token-sum``: the plain sum over masked tokens, no normalisation (each micro-batch's
      share is its own sum, so the shares add up to the batch's sum). The gradient grows
      with the number of tokens: scale the learning rate down accordingly.
    * ``seq-mean-token-sum``: per-row masked sum, summed / ``global_sequences`` (default B).
    * ``seq-mean-token-mean``: per-row masked sum / (row token count + 1e-8), summed /
      ``global_sequences``.
    * ``seq-mean-token-sum-norm``: per-row masked sum / ``norm_length``, summed /
      ``global_sequences``. ``norm_length`` is the padded response length; it defaults to
      ``T`` (the width of ``loss_mat``), so pass it when micro-batches differ in width or
      when ``T`` includes the prompt.

    Rows count as sequences even when their mask is empty (they add 0 to the sum).
    Masked-out entries never reach the result (even non-finite ones). A micro-batch with
    no masked token and no global count gives 0.
    """
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} differ in shape")
    m = mask.bool()
    kept = torch.where(m, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    if mode == "token-mean":
        denom = global_tokens if global_tokens is not None else m.sum()
        return kept.sum() / _at_least_one(denom)
    if mode == "token-sum":
        return kept.sum()
    rows = kept.sum(dim=-1)
    if mode == "seq-mean-token-sum":
        per_seq = rows
    elif mode == "seq-mean-token-mean":
        per_seq = rows / (m.sum(dim=-1).to(rows.dtype) + 1e-8)
    elif mode == "seq-mean-token-sum-norm":
        per_seq = rows / float(norm_length if norm_length is not None else loss_mat.shape[-1])
    else:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose from {', '.join(AGG_MODES)}")
    denom = global_sequences if global_sequences is not None else loss_mat.shape[0]
    return per_seq.sum() / _at_least_one(denom)


def _at_least_one(count: int | float | torch.Tensor) -> int | float | torch.Tensor:
    """A zero count means nothing to average; dividing a zero sum by 1 gives 0, not nan."""
    if isinstance(count, torch.Tensor):
        return count.clamp(min=1)
    return count if count > 0 else 1
