"""Translating geartrain's :class:`~geartrain.types.SamplingParams` into vLLM requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from geartrain.layout import max_tokens_of, native_stop_token_ids
from geartrain.seeding import prompt_indices, sample_seed
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


def build_requests(prompts: list[list[int]], sampling: SamplingParams, *, per_prompt: bool = False) -> Requests:
    """vLLM requests for ``sampling.n`` samples of each prompt.

    * Log-probs: ``logprobs=0`` returns the sampled token's log-prob only, in vLLM's default
      ``raw_logprobs`` mode (before temperature / top-k / top-p), as the hook asks.
    * Stopping: only ``stop_token_ids`` and ``stop_sequences`` stop a sample (``ignore_eos``;
      the checkpoint's generation config is not used either, see ``engine_kwargs``). vLLM
      stops on single tokens only (its stop *strings* need detokenisation): one-token
      sequences join ``stop_token_ids``; longer ones are cut after generation
      (:func:`geartrain.layout.stop_after_generation`, in :mod:`geartrain_vllm.outputs`), so
      such a sample runs on to its budget before it is cut.
    * Budgets: ``max_tokens_per_prompt`` gives each prompt's requests their own ``max_tokens``.
    * Seeds: with ``sampling.seed``, every sample is its own ``n = 1`` request seeded with
      :func:`geartrain.seeding.sample_seed` of (seed, the prompt's index in the step, the
      sample's index), so a sample is the same whichever rank generates it and whatever
      else is in the call (vLLM's prefix cache shares the prompt between them).
      With ``per_prompt`` (``options.seeded_requests = "per_prompt"``) a seeded call is one
      request of ``n`` samples per prompt without a seed of its own (the engine's seed).
    * Greedy with ``n > 1`` (which vLLM refuses): ``n`` requests with ``n = 1`` each.
    """
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt

    greedy = sampling.temperature < GREEDY_TEMPERATURE
    seeded = sampling.seed is not None and not per_prompt
    copies, per_request = (sampling.n, 1) if (greedy or seeded) and sampling.n > 1 else (1, sampling.n)
    global_index = prompt_indices(sampling.prompt_indices, len(prompts))
    budgets = max_tokens_of(sampling, len(prompts))
    stop_token_ids = native_stop_token_ids(sampling)

    def params(max_tokens: int, seed: int | None) -> Any:
        return VllmSamplingParams(
            n=per_request,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0,
            min_p=sampling.min_p,
            repetition_penalty=sampling.repetition_penalty,
            max_tokens=max_tokens,
            stop_token_ids=stop_token_ids,
            seed=seed,
            logprobs=0,
            flat_logprobs=True,
            ignore_eos=True,
            detokenize=False,
        )

    owners = [i for i in range(len(prompts)) for _ in range(copies)]
    tokens = [TokensPrompt(prompt_token_ids=list(prompts[i])) for i in owners]
    if not seeded and sampling.max_tokens_per_prompt is None:
        return Requests(prompts=tokens, params=params(sampling.max_tokens, None), owners=owners)
    per_request_params = [
        params(budgets[i], sample_seed(sampling.seed, global_index[i], j) if seeded else None)
        for i in range(len(prompts))
        for j in range(copies)
    ]
    return Requests(prompts=tokens, params=per_request_params, owners=owners)
