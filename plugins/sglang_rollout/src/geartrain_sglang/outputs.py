"""Turning SGLang's generate outputs into the core's rollout :class:`~geartrain.batch.Batch`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from geartrain.batch import Batch


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
    prompts: Sequence[Sequence[int]], owners: Sequence[int], outputs: Sequence[Any]
) -> list[Sample]:
    """One :class:`Sample` per request output (request ``r`` samples for ``owners[r]``)."""
    samples = []
    for index, out in zip(owners, outputs, strict=True):
        tokens = [int(t) for t in out["output_ids"]]
        meta = out["meta_info"]
        samples.append(
            Sample(
                prompt_index=index,
                prompt=prompts[index],
                tokens=tokens,
                log_probs=sampled_log_probs(tokens, meta),
                finish_reason=finish_reason(meta),
            )
        )
    return samples


def to_batch(samples: Sequence[Sample], pad_token_id: int) -> Batch:
    """The rollout batch the ``generate`` hook specifies: prompts left-padded to the widest
    prompt, responses right-padded to the longest, per-token tensors aligned to ``input_ids``."""
    prompt_width = max((len(s.prompt) for s in samples), default=0)
    response_width = max((len(s.tokens) for s in samples), default=0)
    rows, width = len(samples), prompt_width + response_width
    input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, width), dtype=torch.long)
    response_mask = torch.zeros((rows, width), dtype=torch.long)
    log_probs = torch.zeros((rows, width), dtype=torch.float32)
    for row, s in enumerate(samples):
        p, r = len(s.prompt), len(s.tokens)
        input_ids[row, prompt_width - p : prompt_width] = torch.as_tensor(s.prompt, dtype=torch.long)
        attention_mask[row, prompt_width - p : prompt_width + r] = 1
        if r:
            input_ids[row, prompt_width : prompt_width + r] = torch.as_tensor(s.tokens, dtype=torch.long)
            response_mask[row, prompt_width : prompt_width + r] = 1
            log_probs[row, prompt_width : prompt_width + r] = torch.as_tensor(s.log_probs, dtype=torch.float32)
    return Batch(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "rollout_log_probs": log_probs,
        },
        meta={
            "prompt_index": [s.prompt_index for s in samples],
            "finish_reason": [s.finish_reason for s in samples],
        },
        info={"prompt_length": prompt_width},
        batch_size=rows,
    )
