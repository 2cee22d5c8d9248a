"""A scripted ``generate`` for the agent runner's plumbing: it stands in for a rollout and
returns the given model turns in order (one episode at a time), so a test decides what
the model "says" and checks what the runner, environments and trainer do with it."""

from __future__ import annotations

from typing import Any

import torch
from geartrain import SamplingParams
from geartrain.layout import sequence_batch


def scripted_generate(tok: Any, model_turns: list[str]) -> Any:
    """A one-episode ``generate`` that returns ``model_turns`` in order, each ending on a
    stop (log-probs 0)."""
    script = [tok.encode(t, add_special_tokens=False) for t in model_turns]

    def generate(prompts: list[list[int]], params: SamplingParams) -> Any:
        out = sequence_batch(prompts, [script.pop(0)], tok.pad_token_id)
        out["rollout_log_probs"] = torch.zeros(out["input_ids"].shape)
        out["finish_reason"] = ["stop"]
        return out

    return generate
