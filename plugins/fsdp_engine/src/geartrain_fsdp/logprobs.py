"""Per-token log-probs and entropy of the next token, computed in chunks so that at most
``chunk_tokens x vocab`` logits exist at once, in forward and in backward (each chunk is
recomputed in backward under activation checkpointing)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _chunk(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, need_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = (hidden @ weight.t()).float()
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if need_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = lse - (probs * logits).sum(-1)
    else:
        entropy = logp.new_zeros(())
    return logp, entropy


def token_log_probs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk_tokens: int, need_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(hidden @ weight.T)[targets]`` (and the entropy of that distribution)
    for ``hidden`` ``[N, H]``, ``weight`` ``[V, H]``, ``targets`` ``[N]``; fp32 results ``[N]``."""
    n = hidden.shape[0]
    if n <= chunk_tokens:
        logp, ent = _chunk(hidden, weight, targets, need_entropy)
        return logp, (ent if need_entropy else None)
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logps, ents = [], []
    for start in range(0, n, chunk_tokens):
        sl = slice(start, start + chunk_tokens)
        if recompute:
            logp, ent = checkpoint(_chunk, hidden[sl], weight, targets[sl], need_entropy, use_reentrant=False)
        else:
            logp, ent = _chunk(hidden[sl], weight, targets[sl], need_entropy)
        logps.append(logp)
        ents.append(ent)
    return torch.cat(logps), (torch.cat(ents) if need_entropy else None)
