"""Turning SGLang's generate outputs into the core's rollout :class:`~geartrain.batch.Batch`."""

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


def finish_reason(meta: dict[str, Any]) -> str:
    """SGLang's finish reason (``{"type": "stop" | "length", ...}``) in the core's vocabulary."""
    reason = meta.get("finish_reason") or {}
    return "stop" if reason.get("type") == "stop" else "length"


def sampled_log_probs(tokens: Sequence[int], meta: dict[str, Any]) -> list[float]:
    """The log-prob of each sampled token from ``output_token_logprobs``
    (``(logprob, token_id, text)`` per position)."""
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise ValueError("SGLang returned no log-probs: the request must set return_logprob")
    if len(entries) != len(tokens):
        raise ValueError(f"SGLang returned {len(entries)} log-probs for {len(tokens)} tokens")
    out = []
    for pos, (token, entry) in enumerate(zip(tokens, entries, strict=True)):
        if int(entry[1]) != int(token):
            raise ValueError(f"SGLang log-prob entry {pos} is for token {entry[1]}, sampled {token}")
        out.append(float(entry[0]))
    return out


def samples_from_outputs(
    prompts: Sequence[Sequence[int]], owners: Sequence[int], outputs: Sequence[Any], sampling: SamplingParams
) -> list[Sample]:
    """One :class:`Sample` per request output (request ``r`` samples for ``owners[r]``),
    each cut after its first multi-token stop sequence (SGLang stops on single tokens only)."""
    samples = []
    for index, out in zip(owners, outputs, strict=True):
        tokens = [int(t) for t in out["output_ids"]]
        meta = out["meta_info"]
        tokens, log_probs, reason = stop_after_generation(
            tokens, sampled_log_probs(tokens, meta), finish_reason(meta), sampling
        )
        samples.append(
            Sample(
                prompt_index=index, prompt=prompts[index], tokens=tokens, log_probs=log_probs, finish_reason=reason
            )
        )
    return samples


def to_batch(samples: Sequence[Sample], pad_token_id: int) -> Batch:
    """Lay ``samples`` out as the rollout batch the ``generate`` hook specifies
    (:func:`geartrain.layout.rollout_batch`, the layout every rollout shares)."""
    return rollout_batch(
        [s.prompt for s in samples],
        [s.tokens for s in samples],
        [s.log_probs for s in samples],
        prompt_index=[s.prompt_index for s in samples],
        finish_reason=[s.finish_reason for s in samples],
        pad_token_id=pad_token_id,
    )
