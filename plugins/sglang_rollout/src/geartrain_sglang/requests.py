"""Translating geartrain's :class:`~geartrain.types.SamplingParams` into SGLang requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from geartrain.layout import max_tokens_of, native_stop_token_ids
from geartrain.seeding import prompt_indices, sample_seed
from geartrain.types import SamplingParams


@dataclass(slots=True)
class Requests:
    """What to pass to ``sglang.Engine.generate``: one request per sample, prompt-major."""

    input_ids: list[list[int]]
    params: list[dict[str, Any]]
    owners: list[int]
    """Index of the geartrain prompt each request samples for."""


def build_requests(prompts: list[list[int]], sampling: SamplingParams, max_model_len: int) -> Requests:
    """One SGLang request per sample (row ``i * n + j``), so each has its own seed.

    * Seeds: with ``sampling.seed``, sample ``j`` of prompt ``i`` is seeded with
      :func:`geartrain.seeding.sample_seed` of (seed, the prompt's index in the step, j).
      SGLang's seeded sampler draws from a hash of (seed, position, token id), independent
      of the batch, so a sample is the same whichever rank generates it.
    * Log-probs: ``return_logprob`` with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (set by
      :func:`geartrain_sglang.engine.configure_environment`): the sampled token's log-prob
      under the model's distribution, before temperature / top-k / top-p.
    * Stopping: only ``stop_token_ids`` and ``stop_sequences`` stop a sample (the stop
      token or sequence is kept). SGLang stops on single tokens (its stop *strings* need
      its tokenizer): one-token sequences join ``stop_token_ids``; longer ones are cut
      after generation (:func:`geartrain.layout.stop_after_generation`, in
      :mod:`geartrain_sglang.outputs`), so such a sample runs on to its budget first.
    * Length: ``max_new_tokens`` is the prompt's budget (``max_tokens_per_prompt`` or
      ``max_tokens``), capped so prompt + response fit ``max_model_len``.
    * The prompt's KV cache is shared between its samples by SGLang's radix cache.
    """
    input_ids, params, owners = [], [], []
    global_index = prompt_indices(sampling.prompt_indices, len(prompts))
    budgets = max_tokens_of(sampling, len(prompts))
    stop_token_ids = native_stop_token_ids(sampling)
    for i, prompt in enumerate(prompts):
        room = max_model_len - len(prompt)
        for j in range(sampling.n):
            p: dict[str, Any] = dict(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else -1,
                max_new_tokens=min(budgets[i], room),
                stop_token_ids=list(stop_token_ids) or None,
                # not ignore_eos: SGLang's ignore_eos ignores stop_token_ids too (the
                # checkpoint's EOS ids are cleared instead, see engine_kwargs)
                ignore_eos=False,
                skip_special_tokens=False,
            )
            if sampling.seed is not None:
                p["sampling_seed"] = sample_seed(sampling.seed, global_index[i], j)
            input_ids.append(list(prompt))
            params.append(p)
            owners.append(i)
    return Requests(input_ids=input_ids, params=params, owners=owners)
