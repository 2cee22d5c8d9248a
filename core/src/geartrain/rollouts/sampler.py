"""The torch rollout's token sampler: temperature, top-k and top-p over a row of logits,
then inverse-CDF sampling with one number per row from that row's own counter-based
stream (:func:`geartrain.seeding.uniforms`).

It never reads a value back to the host (no ``.item()``, no data-dependent branch), so the
static-cache decode can run it inside a CUDA graph with the step counter as a device
tensor; the dynamic loop calls the same function with an int counter and gets the same
tokens.
"""

from __future__ import annotations

import torch

from geartrain.seeding import uniforms
from geartrain.types import SamplingParams

__all__ = ["GREEDY_TEMPERATURE", "filter_logits", "sample_tokens"]

#: Below this temperature sampling is greedy (argmax), as in vLLM.
GREEDY_TEMPERATURE = 1e-5


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Logits ``[b, V]`` scaled by ``temperature`` with everything outside the top-k, then
    outside the top-p nucleus (the smallest most-probable set whose mass reaches ``top_p``),
    set to ``-inf``. Ties at the top-k boundary are all kept."""
    scaled = logits / temperature
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        probs = torch.softmax(scaled, dim=-1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep a token when the mass strictly before it is below top_p (the first always stays).
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample_tokens(
    logits: torch.Tensor, sampling: SamplingParams, seeds: torch.Tensor, counter: int | torch.Tensor
) -> torch.Tensor:
    """One token per row of ``logits`` ``[b, V]`` (float32); row ``i`` draws the
    ``counter``-th number of the stream of ``seeds[i]`` (an int64 tensor on any device;
    ``counter`` an int or a 0-d int64 tensor on the logits' device)."""
    if sampling.temperature < GREEDY_TEMPERATURE:
        return logits.argmax(dim=-1)
    filtered = filter_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    probs = torch.softmax(filtered, dim=-1)
    if isinstance(counter, torch.Tensor):
        seeds = seeds.to(counter.device)
    u = uniforms(seeds, counter).to(device=logits.device, dtype=probs.dtype)
    cdf = torch.cumsum(probs, dim=-1)
    u = u * cdf[:, -1]  # the cdf's last value is 1 up to rounding
    tokens = torch.searchsorted(cdf, u.unsqueeze(-1), right=True).squeeze(-1)
    # The first index whose cdf exceeds u has mass (its cdf rose there). Only when u rounds
    # up to the cdf's last value does the search run past the end: then take the token where
    # the cdf reaches that value, the last one with mass (no host-side check needed).
    last_with_mass = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False).squeeze(-1)
    tokens = torch.where(tokens >= probs.shape[-1], last_with_mass, tokens)
    # A row of non-finite logits has a NaN cdf, and both searches run past the end: keep the
    # index inside the vocabulary so that nothing downstream reads out of bounds; its log-prob
    # is NaN, which the rollout batch refuses (geartrain.layout.check_finite_log_probs).
    return tokens.clamp(max=probs.shape[-1] - 1)
