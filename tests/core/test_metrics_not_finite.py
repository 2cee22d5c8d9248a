"""A non-finite metric (a plugin's ``optimizer_step`` reporting NaN, an overflowing loss) is
written to metrics.jsonl as ``null`` (JSON has no NaN), and said once per metric in the log
rather than vanishing without a word (issue 35, probe 41 of round 8)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from geartrain.trainer.metrics import JsonlLogger


def test_a_non_finite_metric_is_written_as_null_and_said_once_per_metric(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "metrics.jsonl"
    log = JsonlLogger(path)
    with caplog.at_level(logging.WARNING, logger="geartrain.metrics"):
        log.write({"phase": "rl", "step": 1, "actor/grad_norm": 0.5, "actor/lr": 1e-3})
        assert caplog.messages == []  # finite: nothing said
        log.write({"phase": "rl", "step": 2, "actor/grad_norm": float("nan"), "actor/lr": float("inf")})
        log.write({"phase": "rl", "step": 3, "actor/grad_norm": float("nan"), "actor/lr": 1e-3})
        log.write({"phase": "rl", "step": 4, "actor/grad_norm": 0.5, "actor/lr": float("-inf")})
        log.write({"phase": "rl", "step": 5, "actor/grad_norm": 0.5, "actor/skipped": float("nan")})
    log.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["actor/grad_norm"], r.get("actor/lr")) for r in rows] == [
        (0.5, 1e-3),
        (None, None),
        (None, 1e-3),
        (0.5, None),
        (0.5, None),
    ]
    assert caplog.messages == [
        "metrics.jsonl, rl step 2: actor/grad_norm = nan, actor/lr = inf are not finite, written as null "
        "(JSON has no NaN or infinity); said once per metric",
        "metrics.jsonl, rl step 5: actor/skipped = nan is not finite, written as null "
        "(JSON has no NaN or infinity); said once per metric",
    ]


def test_a_nested_non_finite_value_is_null_and_the_line_stays_json(tmp_path: Path, caplog) -> None:
    """Issue 35, round 14: a reward's ``log_extra`` NaN reached completions.jsonl as a bare
    ``NaN`` (no JSON reader but Python's accepts it), where metrics.jsonl wrote null and said so."""
    path = tmp_path / "completions.jsonl"
    log = JsonlLogger(path)
    with caplog.at_level("WARNING"):
        log.write({"kind": "train", "step": 1, "rewards": {"fmt": float("nan")}, "columns": [1.0, float("inf")]})
    log.close()
    line = path.read_text().strip()
    assert "NaN" not in line and "Infinity" not in line
    assert json.loads(line) == {"kind": "train", "step": 1, "rewards": {"fmt": None}, "columns": [1.0, None]}
    assert caplog.messages == [
        "completions.jsonl, train step 1: rewards.fmt = nan, columns[1] = inf are not finite, written as null "
        "(JSON has no NaN or infinity); said once per metric"
    ]
