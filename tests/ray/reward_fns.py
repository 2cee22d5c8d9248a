"""Reward functions the reward-worker tests load from this file (``reward_fns.py:name``),
as a job names a user's reward: Ray ships them to the workers by value."""

from __future__ import annotations

import os


def pid_reward(response: str, ground_truth: str) -> dict[str, float]:
    """Partial credit (as ``ray_helpers.digit_reward``), the scoring process's id as an extra,
    and a failure on every response that starts with '7' (counted in ``reward/errors``)."""
    if response.startswith("7"):
        raise ValueError("seven")
    hits = sum(a == b for a, b in zip(response, ground_truth, strict=False))
    score = hits / max(len(ground_truth), 1) - 0.1 * abs(len(response) - len(ground_truth))
    return {"score": score, "acc": float(response.strip() == ground_truth), "pid": float(os.getpid())}
