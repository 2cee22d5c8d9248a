"""Turning SGLang's generate outputs into the core's samples (:class:`geartrain.layout.Sample`,
laid out as the rollout batch by :func:`geartrain.layout.samples_batch`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from geartrain.layout import Sample
from geartrain.types import SamplingParams


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
        log_probs = sampled_log_probs(tokens, meta)
        samples.append(Sample.generated(index, prompts[index], tokens, log_probs, finish_reason(meta), sampling))
    return samples
