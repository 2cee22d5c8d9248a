"""A reward function's extra values cannot overwrite the reward's own metrics (issue 35,
round 12: returning ``{"score": 0.0, "mean": 123.0, "errors": 7.0}`` made ``reward/mean``
123 and ``reward/errors`` 7 in metrics.jsonl, silently, while every sample scored 0)."""

from __future__ import annotations

import logging

import pytest
from geartrain.rewards import scoring
from geartrain.rewards.scoring import RewardScorer, summarize


def loud(response: str, ground_truth: str, **kwargs: object) -> dict[str, float]:
    return {"score": 0.0, "mean": 123.0, "errors": 7.0, "length": float(len(response))}


def test_extras_named_like_the_rewards_own_metrics_are_renamed_and_said(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scoring, "_RENAMED_EXTRAS", set())  # said once per process: this test's own
    result = RewardScorer(loud).score(["ab", "abcd"], ["x", "y"])
    with caplog.at_level(logging.WARNING, logger="geartrain.rewards"):
        metrics = summarize(result.scores.tolist(), result.extras, {"loud": [0.0, 0.0]}, [], [])
    assert metrics["reward/mean"] == 0.0 and metrics["reward/errors"] == 0.0
    assert metrics["reward/extra/mean"] == 123.0 and metrics["reward/extra/errors"] == 7.0
    assert metrics["reward/length"] == 3.0  # a name of its own keeps it
    assert "extra value 'mean' is reported as reward/extra/mean" in caplog.text
