"""Turning vLLM's request outputs into the core's samples (:class:`geartrain.layout.Sample`,
laid out as the rollout batch by :func:`geartrain.layout.samples_batch`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from geartrain.layout import Sample
from geartrain.types import SamplingParams


def sampled_log_probs(tokens: Sequence[int], logprobs: object) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-position log-probs (a
    ``FlatLogprobs`` or a list of ``{token_id: Logprob}`` dicts)."""
    if logprobs is None:
        raise ValueError("vLLM returned no log-probs: the request must ask for logprobs=0")
    starts = getattr(logprobs, "start_indices", None)
    if starts is not None:  # FlatLogprobs: the sampled token comes first at each position
        ids, values = logprobs.token_ids, logprobs.logprobs  # type: ignore[attr-defined]
        out = []
        for pos, token in enumerate(tokens):
            start = starts[pos]
            if ids[start] != token:
                raise ValueError(f"vLLM log-prob entry {pos} is for token {ids[start]}, sampled {token}")
            out.append(float(values[start]))
        return out
    return [float(position[token].logprob) for token, position in zip(tokens, logprobs, strict=True)]  # type: ignore[attr-defined]


def finish_reason(reason: str | None) -> str:
    """vLLM's finish reason in the core's vocabulary (``stop`` or ``length``)."""
    return "stop" if reason == "stop" else "length"


def samples_from_outputs(
    prompts: Sequence[Sequence[int]], owners: Sequence[int], outputs: Sequence[Any], sampling: SamplingParams
) -> list[Sample]:
    """One :class:`Sample` per completion of vLLM's ``RequestOutput`` list (request ``r``
    samples for prompt ``owners[r]``), in request then completion order, each cut after
    its first multi-token stop sequence (vLLM stops on single tokens only)."""
    samples = []
    for index, request in zip(owners, outputs, strict=True):
        for completion in sorted(request.outputs, key=lambda c: c.index):
            tokens = list(completion.token_ids)
            log_probs = sampled_log_probs(tokens, completion.logprobs)
            reason = finish_reason(completion.finish_reason)
            samples.append(Sample.generated(index, prompts[index], tokens, log_probs, reason, sampling))
    return samples
