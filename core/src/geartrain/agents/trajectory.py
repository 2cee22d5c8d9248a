"""An episode as token ids, token in and token out, and its training row.

The episode is the task prompt's ids followed by segments: the model's turns (the ids the
rollout sampled, with their log-probs) and observations (tokenized once when they arrive,
never re-tokenized with the history). Nothing is ever decoded and encoded again, so the
trainer scores exactly the ids that were sampled.

:func:`episode_batch` lays episodes out as the usual rollout batch (see
:mod:`geartrain.layout`): the task prompt left-padded, then everything after it as the
"response" region, with ``response_mask`` 1 on the model's tokens only and
``rollout_log_probs`` on those tokens only. Every loss, estimator and aggregation, and an
engine's packing and shared-prompt prefix (the task prompt), work on it unchanged;
estimators skip the masked gaps (:mod:`geartrain.algorithms.advantages`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from geartrain.batch import Batch
from geartrain.layout import sequence_batch

__all__ = ["Episode", "Segment", "episode_batch"]


@dataclass(kw_only=True, slots=True)
class Segment:
    """A run of tokens after the prompt: one model turn or one observation."""

    kind: Literal["model", "observation"]
    ids: list[int]
    text: str
    log_probs: list[float] | None = None
    """Model turns: the rollout's log-prob of each id."""
    reward: float = 0.0
    """Model turns: the environment's reward for this turn."""
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class Episode:
    """One episode's state and record (see the module docstring)."""

    index: int
    """The episode's index in the whole step: keys its sampling streams (with the turn)."""
    group: int
    """Index of its task in the step's prompts (GRPO groups episodes of one task)."""
    prompt_ids: list[int]
    task: dict[str, Any]
    segments: list[Segment] = field(default_factory=list)
    done: bool = False
    truncated: bool = False
    """Ended by the episode's token budget (``max_episode_tokens`` / ``max_model_len``)."""
    finish: str = ""
    """Why it ended: ``done`` (the environment), ``max_turns``, ``truncated``, ``error``."""
    error: str | None = None
    prompt_extension: str = ""
    """Text an environment's ``reset`` appended to the prompt's last user message
    (``reset_extends_prompt``); ``prompt_ids`` already hold its tokens."""
    prompt_text: str = ""
    """With a ``prompt_extension``: the prompt as the model saw it, decoded."""
    env: Any = None
    environment_state: dict[str, Any] | None = None
    """The environment's plain-data attributes when the episode ended
    (:func:`geartrain.agents.env_state.capture_state`): what reward functions get as
    ``environments``."""

    # ------------------------------------------------------------------ views
    @property
    def model_turns(self) -> int:
        return sum(s.kind == "model" for s in self.segments)

    @property
    def used(self) -> int:
        """Tokens after the prompt so far (model and observation)."""
        return sum(len(s.ids) for s in self.segments)

    def token_ids(self) -> list[int]:
        """Everything so far: the next turn's prompt."""
        return self.prompt_ids + [t for s in self.segments for t in s.ids]

    def response_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.ids]

    def response_mask(self) -> list[int]:
        return [int(s.kind == "model") for s in self.segments for _ in s.ids]

    def response_log_probs(self) -> list[float]:
        return [
            lp
            for s in self.segments
            for lp in (s.log_probs if s.kind == "model" and s.log_probs is not None else [0.0] * len(s.ids))
        ]

    def turn_rewards(self) -> list[float]:
        """Per response token: each model turn's reward on its last token, 0 elsewhere."""
        out: list[float] = []
        for s in self.segments:
            out.extend([0.0] * len(s.ids))
            if s.kind == "model" and s.ids:
                out[-1] += s.reward
        return out

    @property
    def final_text(self) -> str:
        """The last model turn's text (the answer a reward function usually checks)."""
        return next((s.text for s in reversed(self.segments) if s.kind == "model"), "")

    def count(self, key: str) -> float:
        return float(sum(s.info.get(key, 0) for s in self.segments))

    def record(self) -> dict[str, Any]:
        """What reward functions and logs see: the turns as text (``role`` ``model`` or
        ``observation``), the tool calls, the environment's rewards and how it ended; with a
        ``prompt_extension``, it and the extended ``prompt``."""
        return {
            "turns": [{"role": s.kind, "text": s.text} for s in self.segments],
            "calls": [c for s in self.segments for c in s.info.get("calls", [])],
            "rewards": [s.reward for s in self.segments if s.kind == "model"],
            "model_turns": self.model_turns,
            "tool_calls": int(self.count("tool_calls")),
            "tool_errors": int(self.count("tool_errors")),
            "tool_latencies_s": [x for s in self.segments for x in s.info.get("tool_latencies_s", [])],
            "model_tokens": sum(len(s.ids) for s in self.segments if s.kind == "model"),
            "observation_tokens": sum(len(s.ids) for s in self.segments if s.kind == "observation"),
            "truncated": self.truncated,
            "finish": self.finish,
            "error": self.error,
            **(
                {"prompt_extension": self.prompt_extension, "prompt": self.prompt_text} if self.prompt_extension else {}
            ),
            **({"environment_state": self.environment_state} if self.environment_state is not None else {}),
        }

    def render(self, prompt_text: str = "") -> str:
        """The episode as text for a log: model turns and observations marked apart."""
        lines = [f"[task] {prompt_text or self.task.get('prompt', '')}"]
        for s in self.segments:
            lines.append(f"[{'model' if s.kind == 'model' else 'obs'}] {s.text}")
        lines.append(f"[end] {self.finish}{' (truncated)' if self.truncated else ''}")
        return "\n".join(lines)


def episode_batch(
    episodes: Sequence[Episode], pad_token_id: int, meta: Mapping[str, Sequence[Any]] | None = None
) -> Batch:
    """The training rows of ``episodes`` (see the module docstring): ``input_ids``,
    ``attention_mask`` (1 on prompt, model and observation tokens), ``response_mask`` (model
    tokens), ``rollout_log_probs`` (model tokens), ``turn_rewards`` (each model turn's
    environment reward on its last token); meta ``prompt_index`` (the task), ``finish_reason``
    (``length`` for a truncated episode, else ``stop``), ``episode`` (:meth:`Episode.record`)."""
    batch = sequence_batch(
        [e.prompt_ids for e in episodes],
        [e.response_ids() for e in episodes],
        pad_token_id,
        log_probs=[e.response_log_probs() for e in episodes],
        meta={
            "prompt_index": [e.group for e in episodes],
            "finish_reason": ["length" if e.truncated else "stop" for e in episodes],
            "episode": [e.record() for e in episodes],
            **dict(meta or {}),
        },
    )
    width = int(batch.info["prompt_length"])
    mask = torch.zeros_like(batch["response_mask"])
    rewards = torch.zeros(mask.shape, dtype=torch.float32)
    for row, e in enumerate(episodes):
        n = e.used
        mask[row, width : width + n] = torch.tensor(e.response_mask(), dtype=mask.dtype)
        rewards[row, width : width + n] = torch.tensor(e.turn_rewards(), dtype=torch.float32)
    batch["response_mask"] = mask
    batch["turn_rewards"] = rewards
    return batch
