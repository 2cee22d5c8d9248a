"""Completions you can read: ``<output_dir>/completions.jsonl``, a few sampled episodes of
every step and the greedy outputs of every validation, with their rewards.

Each line is one episode::

    {"phase": "rl", "kind": "train", "step": 7, "prompt": "...", "response": "...",
     "reward": 0.9, "rewards": {"correct": 1.0, "short": -0.1}, "advantage": 1.2,
     "ground_truth": "...", "uid": "0:13"}

A multi-turn episode (``rollout.agent``) adds ``"turns"``: each model turn and observation
as ``{"role": "model" | "observation", "text": ...}``, and ``"env_rewards"``: the environment's
reward of each model turn (``reward`` is the reward function's), and ``"finish"``: how it
ended, ``done`` (the environment ended it), ``max_turns``, ``truncated`` (out of tokens:
``max_episode_tokens`` / ``rollout.max_model_len``) or ``error`` (with ``"error"``, the
environment's failure); ``response`` is its last model turn.

``kind`` is ``train`` (``trainer.log_completions`` samples of the step, drawn from the step's
seed) or ``validation`` (every greedy output, ``advantage`` absent). On resume the lines past
the checkpoint's step are dropped, as in ``metrics.jsonl``. The same rows go to TensorBoard as
a text table (``completions/train``, ``completions/validation``).
"""

from __future__ import annotations

import random
import unicodedata
from pathlib import Path
from typing import Any

from geartrain.batch import Batch
from geartrain.trainer.metrics import JsonlLogger


def episodes(batch: Batch, indices: list[int], *, step: int, kind: str) -> list[dict[str, Any]]:
    """The rows ``indices`` of a rewarded ``batch`` as completion records."""
    mask = batch["response_mask"].bool()
    advantages = batch["advantages"] if "advantages" in batch else None
    out = []
    for i in indices:
        record: dict[str, Any] = {
            "phase": "rl",
            "kind": kind,
            "step": step,
            "prompt": batch["prompt"][i],
            "response": batch["response_text"][i],
            "reward": float(batch["score"][i]),
            "rewards": dict(batch["reward_terms"][i]) if "reward_terms" in batch else {},
            "ground_truth": batch["ground_truth"][i],
            "uid": batch["uid"][i],
        }
        if "reward_columns" in batch.meta:  # what reward functions logged (TRL's log_extra)
            record["columns"] = dict(batch["reward_columns"][i])
        if "episode" in batch.meta:  # a multi-turn episode: every turn, not only the last
            record["turns"] = batch["episode"][i]["turns"]
            record["env_rewards"] = batch["episode"][i]["rewards"]
            # how it ended: done (the environment), max_turns, truncated (its token budget), error
            record["finish"] = batch["episode"][i]["finish"]
            if batch["episode"][i].get("error"):
                record["error"] = batch["episode"][i]["error"]
        if advantages is not None and kind == "train":
            row = advantages[i][mask[i]]
            record["advantage"] = float(row.mean()) if row.numel() else 0.0
        out.append(record)
    return out


class CompletionsLogger:
    """Writes ``per_step`` episodes of each step (and every validation output) to
    ``path``; ``tensorboard`` (a ``SummaryWriter``) also gets them as a text table."""

    def __init__(
        self,
        path: str | Path,
        per_step: int,
        *,
        seed: int,
        resume_step: int | None = None,
        tensorboard: Any | None = None,
    ) -> None:
        self.jsonl = JsonlLogger(path, resume_step=resume_step)
        self.per_step = per_step
        self.seed = seed
        self.tensorboard = tensorboard

    def train(self, step: int, batch: Batch) -> None:
        """``per_step`` of the step's samples, drawn with the step's own seed."""
        picked = pick(len(batch), self.per_step, self.seed, step)
        self._write(episodes(batch, picked, step=step, kind="train"), step, "train")

    def validation(self, step: int, batch: Batch) -> None:
        """Every greedy validation output."""
        self._write(episodes(batch, list(range(len(batch))), step=step, kind="validation"), step, "validation")

    def _write(self, records: list[dict[str, Any]], step: int, kind: str) -> None:
        for record in records:
            self.jsonl.write(record)
        if self.tensorboard is not None and records:
            self.tensorboard.add_text(f"completions/{kind}", markdown_table(records), step)

    def close(self) -> None:
        self.jsonl.close()


def markdown_table(records: list[dict[str, Any]]) -> str:
    """The records as a Markdown table (TensorBoard renders it in its Text tab)."""

    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "⏎")[:300]

    terms = sorted({k for r in records for k in r["rewards"]})
    head = ["prompt", "response", "reward", *terms, "advantage"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        row = [
            r["prompt"],
            r["response"],
            r["reward"],
            *(r["rewards"].get(t, "") for t in terms),
            r.get("advantage", ""),
        ]
        lines.append("| " + " | ".join(cell(v) for v in row) + " |")
    return "\n".join(lines)


def pick(n: int, k: int, seed: int, step: int) -> list[int]:
    """``k`` of a step's ``n`` samples, drawn with the step's own seed (the same on resume)."""
    return sorted(random.Random(seed * 1_000_003 + step).sample(range(n), min(k, n)))


def visible(text: str) -> str:
    """``text`` safe to print on a terminal, on one line: a newline as ``⏎``, a tab as a
    space, and every other control or format character (an escape sequence's ESC, a carriage
    return, a right-to-left override) as its ``\\x1b`` / ``\\u202e`` escape. Prompts and
    completions are data: printed raw, an escape sequence in them would drive the reader's
    terminal (retitle it, clear it, on some write the clipboard)."""
    out = []
    for char in text:
        if char == "\n":
            out.append("⏎")
        elif char == "\t":
            out.append(" ")
        elif unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp"):
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(char)
    return "".join(out)


def console_table(records: list[dict[str, Any]], width: int = 100) -> str:
    """The records as a plain-text table for the console (TRL's completions table): step,
    prompt and completion (shortened to fit ``width``, newlines as ``⏎``), reward, each
    reward function's score (when there are several) and the advantage."""
    terms = sorted({k for r in records for k in r["rewards"]})
    terms = terms if len(terms) > 1 else []  # one function's score is the reward
    numbers = ["reward", *terms, *(["advantage"] if any("advantage" in r for r in records) else [])]

    def number(r: dict[str, Any], key: str) -> str:
        value = r.get(key) if key in ("reward", "advantage") else r["rewards"].get(key)
        return "" if value is None else f"{value:.3g}"

    num_w = [max(len(k), 6) for k in numbers]
    step_w = max(4, *(len(str(r["step"])) for r in records))
    text_w = max(20, width - step_w - sum(w + 3 for w in num_w) - 7)
    prompt_w = text_w * 2 // 5
    response_w = text_w - prompt_w

    def fit(text: str, w: int) -> str:
        text = visible(text)
        return (text if len(text) <= w else text[: w - 1] + "…").ljust(w)

    head = [fit("step", step_w), fit("prompt", prompt_w), fit("completion", response_w)]
    head += [k[:w].rjust(w) for k, w in zip(numbers, num_w, strict=True)]
    rule = "-+-".join("-" * len(h) for h in head)
    lines = [" | ".join(head), rule]
    for r in records:
        row = [str(r["step"]).rjust(step_w), fit(r["prompt"], prompt_w), fit(r["response"], response_w)]
        row += [number(r, k).rjust(w) for k, w in zip(numbers, num_w, strict=True)]
        lines.append(" | ".join(row))
    return "\n".join(lines)


__all__ = ["CompletionsLogger", "console_table", "episodes", "markdown_table", "pick"]
