"""Environments of the Ray episode tests (named in ``rollout.agent.environment``)."""

from __future__ import annotations

from typing import Any

from geartrain.agents import Environment, StepResult


class ThreeTurns(Environment):
    """Every episode has three model turns, whatever the model writes: a fixed observation
    after each of the first two (so even a random policy runs multi-turn episodes)."""

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, task: dict[str, Any]) -> str:
        return ""

    def step(self, action: str) -> StepResult:
        self.turns += 1
        return StepResult(observation=f"({self.turns})", done=self.turns >= 3)
