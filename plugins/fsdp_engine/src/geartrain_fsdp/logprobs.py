"""Per-token log-probs of the next token, and on request the entropy and ``Σ_v π(v)²`` of
that distribution, computed in chunks so that at most ``chunk_tokens x vocab`` logits
exist at once, in forward and in backward.

Two ways to train through it (``fused``):

* fused (the default): :class:`LinearLogProbs`, a linear log-prob / entropy head with its
  own backward (Liger's and verl's fused linear cross-entropy, with the entropy term).
  Forward keeps nothing of a chunk's logits; backward recomputes each chunk's logits once
  and writes the gradient of the logits in closed form,
  ``dz = g_logp (onehot(t) - p) - g_ent p (z - E_p[z])``, straight into the hidden-state
  and weight gradients (fp32 accumulation of the weight's). Per chunk that is one matmul
  forward, one recomputation and two backward matmuls, with one ``[chunk, vocab]`` fp32
  buffer at a time;
* checkpointed: each chunk under activation checkpointing, autograd through
  ``logsumexp`` / ``softmax`` (the recomputed forward keeps the chunk's logits, softmax and
  their products for its backward; several ``[chunk, vocab]`` buffers).

Both compute the forward with :func:`_chunk`. With a ``backend`` (the engine's
``options.compile_backend`` when ``options.compile``) the per-chunk functions are
``torch.compile``-d, so each chunk's elementwise work fuses around its matmuls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["LinearLogProbs", "token_log_probs"]


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


def _chunk_logits_grad(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor | None,
) -> torch.Tensor:
    """The gradient of the chunk's logits ``[n, V]`` (fp32) given the gradients of its
    log-probs and entropies ``[n]``: ``d logp / dz = onehot(t) - p``,
    ``d H / dz = -p (z - E_p[z])``."""
    logits = (hidden @ weight.t()).float()
    probs = torch.softmax(logits, dim=-1)
    grad = probs * (-grad_logp.unsqueeze(-1))
    if grad_entropy is not None:
        mean = (probs * logits).sum(-1, keepdim=True)
        grad = grad - probs * (logits - mean) * grad_entropy.unsqueeze(-1)
    return grad.scatter_add(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1))


_COMPILED: dict[tuple[str, str], Callable[..., Any]] = {}


def _fn(name: str, backend: str | None) -> Callable[..., Any]:
    fn = {"forward": _chunk, "backward": _chunk_logits_grad}[name]
    if backend is None:
        return fn
    if (name, backend) not in _COMPILED:
        _COMPILED[(name, backend)] = torch.compile(fn, backend=backend, dynamic=True)
    return _COMPILED[(name, backend)]


class LinearLogProbs(torch.autograd.Function):
    """``(log_probs [N], entropy [N], sum_pi_squared [N])`` (each not asked for a 0-d zero;
    ``sum_pi_squared`` without gradient) of ``hidden [N, H] @ weight.T [H, V]`` at
    ``targets [N]``, chunk by chunk, with the closed-form backward described in the module
    docstring. Gradients have the dtypes of ``hidden`` and ``weight``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk_tokens: int,
        need_entropy: bool,
        need_sum_pi_squared: bool,
        backend: str | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        forward = _fn("forward", backend)
        parts = [
            forward(
                hidden[start : start + chunk_tokens],
                weight,
                targets[start : start + chunk_tokens],
                need_entropy,
                need_sum_pi_squared,
            )
            for start in range(0, hidden.shape[0], chunk_tokens)
        ]
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk_tokens, ctx.need_entropy, ctx.backend = chunk_tokens, need_entropy, backend
        logp = torch.cat([p[0] for p in parts])
        entropy = torch.cat([p[1] for p in parts]) if need_entropy else logp.new_zeros(())
        sum_pi_squared = torch.cat([p[2] for p in parts]) if need_sum_pi_squared else logp.new_zeros(())
        ctx.mark_non_differentiable(sum_pi_squared)
        return logp, entropy, sum_pi_squared

    @staticmethod
    def backward(
        ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None, _grad_sum_pi_squared: Any
    ) -> tuple[Any, ...]:
        hidden, weight, targets = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_logp is None:
            grad_logp = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        if not ctx.need_entropy:
            grad_entropy = None
        logits_grad = _fn("backward", ctx.backend)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            sl = slice(start, start + ctx.chunk_tokens)
            dz = logits_grad(
                hidden[sl],
                weight,
                targets[sl],
                grad_logp[sl].float(),
                grad_entropy[sl].float() if grad_entropy is not None else None,
            )
            if grad_hidden is not None:
                grad_hidden[sl] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += (dz.to(hidden.dtype).t() @ hidden[sl]).float()
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            None,
            None,
            None,
            None,
            None,
        )


def token_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_tokens: int,
    need_entropy: bool,
    need_sum_pi_squared: bool = False,
    fused: bool = True,
    backend: str | None = None,
) -> dict[str, torch.Tensor]:
    """For ``hidden`` ``[N, H]``, ``weight`` ``[V, H]``, ``targets`` ``[N]``: fp32 ``[N]``
    results of the distribution ``softmax(hidden @ weight.T)``: ``log_probs`` (of
    ``targets``), and when asked ``entropy`` and ``sum_pi_squared`` (``Σ_v π(v)²``,
    detached: it carries no gradient). When a gradient is needed, ``fused`` trains through
    :class:`LinearLogProbs`, otherwise through checkpointed chunks; ``backend`` compiles
    the per-chunk functions with it."""
    n = hidden.shape[0]
    flags = (need_entropy, need_sum_pi_squared)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    forward = _fn("forward", backend)
    if grad and fused:
        parts = [LinearLogProbs.apply(hidden, weight, targets, chunk_tokens, *flags, backend)]
    elif n <= chunk_tokens:
        parts = [forward(hidden, weight, targets, *flags)]
    else:
        parts = []
        for start in range(0, n, chunk_tokens):
            sl = slice(start, start + chunk_tokens)
            if grad:
                parts.append(checkpoint(forward, hidden[sl], weight, targets[sl], *flags, use_reentrant=False))
            else:
                parts.append(forward(hidden[sl], weight, targets[sl], *flags))
    out = {"log_probs": torch.cat([p[0] for p in parts])}
    if need_entropy:
        out["entropy"] = torch.cat([p[1] for p in parts])
    if need_sum_pi_squared:
        out["sum_pi_squared"] = torch.cat([p[2] for p in parts])
    return out
