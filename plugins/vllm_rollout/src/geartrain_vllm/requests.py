"""Translating geartrain's :class:`~geartrain.types.SamplingParams` into vLLM requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from geartrain.types import SamplingParams

#: vLLM samples greedily below this temperature (its ``_SAMPLING_EPS``).
GREEDY_TEMPERATURE = 1e-5


@dataclass(slots=True)
class Requests:
    """What to pass to ``vllm.LLM.generate``, and which prompt each request belongs to."""

    prompts: list[Any]
    """``TokensPrompt`` per request."""
    params: Any
    """One ``vllm.SamplingParams`` for all requests, or one per request."""
    owners: list[int]
    """Index of the geartrain prompt each request samples for."""


def build_requests(prompts: list[list[int]], sampling: SamplingParams) -> Requests:
    """vLLM requests for ``sampling.n`` samples of each prompt.

    * Log-probs: ``logprobs=0`` returns the sampled token's log-prob only, in vLLM's default
      ``raw_logprobs`` mode (before temperature / top-k / top-p), as the hook asks.
    * Stopping: only ``stop_token_ids`` stop a sample (``ignore_eos``; the checkpoint's
      generation config is not used either, see ``engine_kwargs``).
    * Seeds: sample ``j`` of prompt ``i`` uses ``seed + i * n + j`` (vLLM gives the ``j``-th
      child of a request ``seed + j``), so every row has its own reproducible stream.
    * Greedy with ``n > 1`` (which vLLM refuses): ``n`` requests with ``n = 1`` each.
    """
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt

    greedy = sampling.temperature < GREEDY_TEMPERATURE
    copies, per_request = (sampling.n, 1) if greedy and sampling.n > 1 else (1, sampling.n)

    def params(index: int) -> Any:
        return VllmSamplingParams(
            n=per_request,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0,
            max_tokens=sampling.max_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            seed=None if sampling.seed is None else sampling.seed + index * sampling.n,
            logprobs=0,
            flat_logprobs=True,
            ignore_eos=True,
            detokenize=False,
        )

    owners = [i for i in range(len(prompts)) for _ in range(copies)]
    tokens = [TokensPrompt(prompt_token_ids=list(prompts[i])) for i in owners]
    per_prompt = [params(i) for i in owners] if sampling.seed is not None else params(0)
    return Requests(prompts=tokens, params=per_prompt, owners=owners)
