"""Per-token log-probs, entropy and ``Σ_v π(v)²`` from vocabulary-parallel logits.

Each tensor-parallel rank holds the logits of its slice of the vocabulary ``[N, V / tp]``;
the full-vocabulary logits are never gathered. Three all-reduces over the TP group (max,
sum of exponentials, and the target logit / expected logit / sum of squared exponentials)
give exact results (``Σπ² = Σ_v exp(2 (z_v - max)) / (Σ_v exp(z_v - max))²``, no gradient),
and the backward is computed locally from the same statistics:

* ``d log p(t) / d z_j = [j = t] - p_j``
* ``d H / d z_j = p_j (E_p[z] - z_j)`` with ``H = lse - E_p[z]``
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _all_reduce(x: torch.Tensor, group: Any, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        vocab_size: int,
        group: Any,
        need_entropy: bool,
        need_sum_pi_squared: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        z = logits.float()
        local_v = z.shape[-1]
        # columns past the real vocabulary (padding so that tp divides it) never count
        valid_cols = torch.arange(vocab_start, vocab_start + local_v, device=z.device) < vocab_size
        if not bool(valid_cols.all()):
            z = z.masked_fill(~valid_cols, float("-inf"))
        zmax = z.max(dim=-1).values
        _all_reduce(zmax, group, dist.ReduceOp.MAX)
        shifted = z - zmax.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(-1), group)
        lse = sum_exp.log()  # of the shifted logits
        probs = exp / sum_exp.unsqueeze(-1)
        local_t = targets - vocab_start
        owned = (local_t >= 0) & (local_t < local_v)
        idx = local_t.clamp(0, local_v - 1).unsqueeze(-1)
        target_logit = torch.where(owned, shifted.gather(-1, idx).squeeze(-1), shifted.new_zeros(()))
        stats = [target_logit]
        if need_entropy:
            expected = torch.where(valid_cols, probs * shifted, probs.new_zeros(())).sum(-1)
            stats.append(expected)
        if need_sum_pi_squared:
            stats.append((exp * exp).sum(-1))  # padding columns: exp(-inf) = 0
        reduced = _all_reduce(torch.stack(stats), group)
        logp = reduced[0] - lse
        if need_entropy:
            expected = reduced[1]
            entropy = lse - expected
        else:
            expected = entropy = logp.new_zeros(())
        sum_pi_squared = reduced[-1] / (sum_exp * sum_exp) if need_sum_pi_squared else logp.new_zeros(())
        ctx.mark_non_differentiable(sum_pi_squared)
        ctx.save_for_backward(probs, shifted, expected, idx.squeeze(-1), owned)
        ctx.need_entropy = need_entropy
        ctx.valid_cols = valid_cols
        ctx.in_dtype = logits.dtype
        return logp, entropy, sum_pi_squared

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, grad_entropy: torch.Tensor, _grad_spp: Any) -> tuple:  # type: ignore[override]
        probs, shifted, expected, idx, owned = ctx.saved_tensors
        grad = -probs * grad_logp.unsqueeze(-1)
        onehot = torch.zeros_like(probs).scatter_(-1, idx.unsqueeze(-1), owned.to(probs.dtype).unsqueeze(-1))
        grad = grad + onehot * grad_logp.unsqueeze(-1)
        if ctx.need_entropy and grad_entropy is not None:
            diff = torch.where(ctx.valid_cols, expected.unsqueeze(-1) - shifted, shifted.new_zeros(()))
            grad = grad + probs * diff * grad_entropy.unsqueeze(-1)
        return grad.to(ctx.in_dtype), None, None, None, None, None, None


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: Any,
    need_entropy: bool,
    need_sum_pi_squared: bool = False,
) -> dict[str, torch.Tensor]:
    """For this rank's vocabulary slice ``logits`` ``[..., V / tp]`` starting at global
    column ``vocab_start`` (the real vocabulary has ``vocab_size`` columns, the rest is
    padding): ``log_probs`` (``log softmax(z)[targets]``) and, when asked, ``entropy`` and
    ``sum_pi_squared`` (``Σ_v softmax(z)_v²``), fp32 ``[...]``, identical on every rank of
    ``group``. Differentiable in ``logits`` (``sum_pi_squared`` carries no gradient)."""
    logp, entropy, spp = _VocabParallelLogProbs.apply(
        logits, targets, vocab_start, vocab_size, group, need_entropy, need_sum_pi_squared
    )
    out = {"log_probs": logp}
    if need_entropy:
        out["entropy"] = entropy
    if need_sum_pi_squared:
        out["sum_pi_squared"] = spp
    return out
