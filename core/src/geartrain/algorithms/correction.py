"""Rollout-vs-trainer mismatch: truncated importance sampling and its metrics.

The rollout engine samples with ``rollout_log_probs``; the trainer recomputes
``old_log_probs`` for the same tokens with the same weights. Kernels, precision and
batching make them differ. The token-level weight ``exp(old - rollout)``, truncated at
``cap`` and detached, multiplies the policy loss (``is_weights=`` of the policy losses) so
the update stays on-policy for the trainer's distribution (truncated IS). The masked
variant (IcePop) drops the tokens whose weight leaves ``[low, high]`` instead.
"""

from __future__ import annotations

import torch

from geartrain.algorithms.kl import kl_estimate


def truncated_is_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, *, cap: float = 2.0
) -> torch.Tensor:
    """``min(exp(old - rollout), cap)`` per token ``[B, T]``, detached; 0 outside ``mask``.
    The log-difference is clamped to ``±20`` before ``exp``."""
    with torch.no_grad():
        log_w = torch.clamp(old_log_probs - rollout_log_probs, -20.0, 20.0)
        w = torch.clamp(torch.exp(log_w), max=cap)
        return torch.where(mask.bool(), w, torch.zeros_like(w))


def masked_is_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float = 0.5,
    high: float = 2.0,
) -> torch.Tensor:
    """IcePop-style masked importance sampling: ``exp(old - rollout)`` per token ``[B, T]``
    where it lies in ``[low, high]``, 0 elsewhere (such tokens leave the gradient instead of
    being capped) and outside ``mask``; detached. The log-difference is clamped to ``±20``."""
    with torch.no_grad():
        w = torch.exp(torch.clamp(old_log_probs - rollout_log_probs, -20.0, 20.0))
        keep = mask.bool() & (w >= low) & (w <= high)
        return torch.where(keep, w, torch.zeros_like(w))


def mismatch_metrics(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float | None = 2.0,
    prefix: str = "rollout_mismatch/",
) -> dict[str, float]:
    """How far trainer and rollout log-probs are apart, over the masked tokens:

    * ``mean_abs_diff`` / ``max_abs_diff`` of ``old - rollout``;
    * ``kl_k3``: the k3 estimate of KL(rollout || trainer) (tokens were sampled by the rollout);
    * ``is_weight_mean`` and, with ``cap``, ``truncated_frac`` (share of tokens whose
      weight hit the cap).

    All 0 when the mask selects nothing.
    """
    with torch.no_grad():
        m = mask.bool()
        if not bool(m.any()):
            out = {"mean_abs_diff": 0.0, "max_abs_diff": 0.0, "kl_k3": 0.0, "is_weight_mean": 0.0}
            if cap is not None:
                out["truncated_frac"] = 0.0
            return {prefix + k: v for k, v in out.items()}
        diff = (old_log_probs - rollout_log_probs)[m].double()
        weights = torch.exp(torch.clamp(diff, -20.0, 20.0))
        out = {
            "mean_abs_diff": float(diff.abs().mean()),
            "max_abs_diff": float(diff.abs().max()),
            "kl_k3": float(kl_estimate(rollout_log_probs[m].double(), old_log_probs[m].double(), "k3").mean()),
            "is_weight_mean": float(weights.mean()),
        }
        if cap is not None:
            out["truncated_frac"] = float((weights > cap).double().mean())
        return {prefix + k: v for k, v in out.items()}
