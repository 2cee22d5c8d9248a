"""Per-token log-probs of the next token, and on request the entropy and ``Σ_v π(v)²`` of
that distribution, computed in chunks so that at most ``chunk_tokens x vocab`` logits
exist at once, in forward and in backward (each chunk is recomputed in backward under
activation checkpointing)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    need_entropy: bool,
    need_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = (hidden @ weight.t()).float()
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if need_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = lse - (probs * logits).sum(-1)
    else:
        entropy = logp.new_zeros(())
    if need_sum_pi_squared:
        # Σ π² = exp(logsumexp(2 z) - 2 logsumexp(z)); an input to advantages, no gradient
        z = logits.detach()
        sum_pi_squared = torch.exp(torch.logsumexp(2.0 * z, dim=-1) - 2.0 * lse.detach())
    else:
        sum_pi_squared = logp.new_zeros(())
    return logp, entropy, sum_pi_squared


def token_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_tokens: int,
    need_entropy: bool,
    need_sum_pi_squared: bool = False,
) -> dict[str, torch.Tensor]:
    """For ``hidden`` ``[N, H]``, ``weight`` ``[V, H]``, ``targets`` ``[N]``: fp32 ``[N]``
    results of the distribution ``softmax(hidden @ weight.T)``: ``log_probs`` (of
    ``targets``), and when asked ``entropy`` and ``sum_pi_squared`` (``Σ_v π(v)²``,
    detached: it carries no gradient)."""
    n = hidden.shape[0]
    flags = (need_entropy, need_sum_pi_squared)
    if n <= chunk_tokens:
        parts = [_chunk(hidden, weight, targets, *flags)]
    else:
        recompute = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        parts = []
        for start in range(0, n, chunk_tokens):
            sl = slice(start, start + chunk_tokens)
            if recompute:
                parts.append(checkpoint(_chunk, hidden[sl], weight, targets[sl], *flags, use_reentrant=False))
            else:
                parts.append(_chunk(hidden[sl], weight, targets[sl], *flags))
    out = {"log_probs": torch.cat([p[0] for p in parts])}
    if need_entropy:
        out["entropy"] = torch.cat([p[1] for p in parts])
    if need_sum_pi_squared:
        out["sum_pi_squared"] = torch.cat([p[2] for p in parts])
    return out
