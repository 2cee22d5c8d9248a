"""The decode step's token choice in as few passes over ``[B, vocab]`` as the arithmetic
allows (issue 33, item 2): the sampled token and its log-prob together.

:func:`~geartrain.rollouts.sampler.sample_tokens` followed by the rollout's
``gather - logsumexp`` reads the logits about ten times per step (an fp32 copy, the
temperature division, softmax's max / exp / sum / divide, the cumulative sum, two
searches, then ``logsumexp`` again for the log-prob): at batch 256 and Qwen's 151,936-token
vocabulary that is as many bytes as the whole step's bandwidth bound.
:func:`sample_with_log_prob` makes, for the common plain sampling (no top-k, no top-p):

* the logits taken in the model's dtype (bf16) and widened to fp32 as read (under
  compile no fp32 copy is kept; eagerly it is one copy, as today);
* no division at temperature 1.0 (dividing by 1.0 is the identity in floating point, so
  the tokens are the same);
* one row maximum and one ``exp`` shared by the sampling CDF and the log-prob's
  normaliser (the unnormalised CDF ``cumsum(exp(x - max))`` is searched at ``u x total``,
  the same point as today's normalised CDF at ``u x cdf[-1]``);

so under ``torch.compile`` (the static decode compiles it with the step on CUDA) it is
one read of the logits for the maximum and one fused exp/scan/search. Top-k / top-p and
greedy keep :func:`~geartrain.rollouts.sampler.sample_tokens` (they sort or take the
argmax anyway). The tokens are today's wherever both use the same noise, up to a uniform
falling within float rounding of a CDF step.
"""

from __future__ import annotations

import torch

from geartrain.rollouts.sampler import GREEDY_TEMPERATURE, sample_tokens
from geartrain.seeding import uniforms
from geartrain.types import SamplingParams

__all__ = ["is_plain", "sample_with_log_prob"]


def is_plain(sampling: SamplingParams) -> bool:
    """True when ``sampling`` is temperature sampling alone (no top-k / top-p, not greedy):
    the case :func:`sample_with_log_prob` fuses."""
    return sampling.temperature >= GREEDY_TEMPERATURE and sampling.top_k <= 0 and sampling.top_p >= 1.0


def sample_with_log_prob(
    logits: torch.Tensor, sampling: SamplingParams, seeds: torch.Tensor, counter: int | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [B] int64, log_probs [B] float32)``: one token per row of ``logits``
    ``[B, V]`` (any float dtype; read in fp32) drawn as
    :func:`~geartrain.rollouts.sampler.sample_tokens` draws it (row ``i`` uses number
    ``counter`` of the stream of ``seeds[i]``), and its log-prob under the *unscaled*
    logits (``log_softmax(logits)[token]``, whatever the temperature). Never reads a value
    back to the host."""
    raw = logits.float()  # under compile: widened as read
    if not is_plain(sampling):
        tokens = sample_tokens(raw, sampling, seeds, counter)
        return tokens, _log_prob(raw, tokens)
    unit = sampling.temperature == 1.0
    scaled = raw if unit else raw / sampling.temperature
    top = scaled.amax(dim=-1, keepdim=True)
    weights = torch.exp(scaled - top)
    cdf = torch.cumsum(weights, dim=-1)
    total = cdf[:, -1:]
    if isinstance(counter, torch.Tensor):
        seeds = seeds.to(counter.device)
    u = uniforms(seeds, counter).to(device=logits.device, dtype=cdf.dtype)
    tokens = torch.searchsorted(cdf, (u.unsqueeze(-1) * total).contiguous(), right=True).squeeze(-1)
    # As sample_tokens: past the end only when u x total rounds to the total; then the last
    # token with mass.
    last_with_mass = torch.searchsorted(cdf, total.contiguous(), right=False).squeeze(-1)
    tokens = torch.where(tokens >= cdf.shape[-1], last_with_mass, tokens)
    # As sample_tokens (issue 39): a row of non-finite logits runs both searches past the end;
    # keep its index inside the vocabulary, its log-prob is NaN and the rollout batch refuses it.
    tokens = tokens.clamp(max=cdf.shape[-1] - 1)
    if unit:  # the normaliser is the sampling's own: log softmax = x - max - log(total)
        picked = raw.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return tokens, picked - top.squeeze(-1) - torch.log(total.squeeze(-1))
    return tokens, _log_prob(raw, tokens)


def _log_prob(raw: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(raw)[tokens]`` without the full ``[B, V]`` log-softmax."""
    return raw.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(raw, dim=-1)
