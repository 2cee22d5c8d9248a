"""Turning vLLM's request outputs into the core's rollout :class:`~geartrain.batch.Batch`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from geartrain.batch import Batch
from geartrain.layout import rollout_batch, stop_after_generation
from geartrain.types import SamplingParams


@dataclass(slots=True)
class Sample:
    """One generated response: its prompt, tokens, per-token log-probs, why it ended."""

    prompt_index: int
    prompt: Sequence[int]
    tokens: Sequence[int]
    log_probs: Sequence[float]
    finish_reason: str


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
            tokens, log_probs, reason = stop_after_generation(
                tokens,
                sampled_log_probs(tokens, completion.logprobs),
                finish_reason(completion.finish_reason),
                sampling,
            )
            samples.append(
                Sample(
                    prompt_index=index, prompt=prompts[index], tokens=tokens, log_probs=log_probs, finish_reason=reason
                )
            )
    return samples


def to_batch(samples: Sequence[Sample], pad_token_id: int) -> Batch:
    """Lay ``samples`` out as the rollout batch the ``generate`` hook specifies
    (:func:`geartrain.layout.rollout_batch`)."""
    return rollout_batch(
        [s.prompt for s in samples],
        [s.tokens for s in samples],
        [s.log_probs for s in samples],
        prompt_index=[s.prompt_index for s in samples],
        finish_reason=[s.finish_reason for s in samples],
        pad_token_id=pad_token_id,
    )
