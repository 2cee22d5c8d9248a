"""Guess the number: an environment with feedback instead of tools.

The task's ``ground_truth`` is a secret digit in ``1..9``. Each model turn is one guess,
a digit followed by ``;`` (the turn's stop text). The environment answers ``+`` (the secret
is higher), ``-`` (lower) or ends the episode when the guess is right. The job
(``grpo.toml``) allows 4 turns: a policy that ignores the hints finds the secret within 4
turns about 38 % of the time (task.py); one that halves the interval with each hint (5,
then 2/3 or 7/8, ...) finds 7 secrets of 9 within 3 turns and every one within 4.

    [rollout.agent]
    environment = "env.py:GuessNumber"
    max_turns = 4

A reply that is not a digit and ``;`` gets the hint ``?`` (a wasted turn).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from geartrain.agents import Environment, StepResult


class GuessNumber(Environment):
    """One episode of guess-the-number (see the module docstring). ``reward`` is 1 for the
    turn that finds the secret; ``info["solved"]`` says whether it was found."""

    stop_texts = (";",)

    def __init__(self, low: int = 1, high: int = 9) -> None:
        self.low, self.high = low, high
        self.secret = 0

    def reset(self, task: Mapping[str, Any]) -> str:
        self.secret = int(task["ground_truth"])
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"secret {self.secret} is outside {self.low}..{self.high}")
        return ""

    def step(self, action: str) -> StepResult:
        guess = parse_guess(action)
        if guess is None:
            return StepResult(observation="?", info={"solved": 0, "invalid": 1})
        if guess == self.secret:
            return StepResult(reward=1.0, done=True, info={"solved": 1})
        return StepResult(observation="+" if self.secret > guess else "-", info={"solved": 0})


def parse_guess(action: str) -> int | None:
    """The guessed digit of a turn ``"5;"``, or ``None`` when the turn is not one digit."""
    text = action.strip()
    if text.endswith(";"):
        text = text[:-1]
    return int(text) if len(text) == 1 and text.isdigit() else None
