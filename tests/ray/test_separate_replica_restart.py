"""A dead rollout replica is replaced, not fatal (``rollout.replica_restarts``): 1 trainer
rank + 2 replicas at ``max_staleness = 0``. Replica 1 is SIGKILLed twice: between two steps
(the next weight broadcast finds it dead) and, once replaced, again mid-generation (its
share of the step's prompts is in flight). With 2 restarts the run completes and equals the
uninterrupted run (placement-invariant sampling, the same weights): the same responses, the
same rewards, losses and gradient norms bit for bit, and after every step both replicas'
weights (the new ones' too) bitwise equal to the trainer's; the restarts are in the metrics
and each is one warning line. With 1 restart the second death ends the run, naming it."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from geartrain.cluster.ray_placement import RankFailure
from ray_helpers import SHORT, assert_reproduces_colocated, recorded_run

pytestmark = [pytest.mark.slow]

STEPS = 4
KEYS = ("reward/mean", "reward/std", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac")
SEPARATE = [
    *SHORT,
    f"trainer.total_steps={STEPS}",
    "trainer.save_every=0",
    "cluster.placement=ray",
    "rollout.placement=separate",
    "rollout.replicas=2",
    "rollout.resources_per_replica={cpus=0.5}",
]
BETWEEN, MID = 2, 3
"""Replica 1 is killed before the 2nd step's weight broadcast, and right after the 3rd
step's prompts were sent to the replicas."""


def _kill_replica_1(generation: Any) -> None:
    os.kill(generation.rollout.pool.where[1]["pid"], signal.SIGKILL)


def _run_killing_replica_1(out: Path, monkeypatch: pytest.MonkeyPatch, restarts: int) -> Any:
    from geartrain.trainer.separate import SeparateGeneration

    original_next, original_send = SeparateGeneration.next, SeparateGeneration._send
    calls = {"next": 0}

    def next_step(self: SeparateGeneration, step: int) -> Any:
        calls["next"] += 1
        if calls["next"] == BETWEEN:
            _kill_replica_1(self)
        return original_next(self, step)

    def send(self: SeparateGeneration, *args: Any) -> Any:
        sent = original_send(self, *args)
        if calls["next"] == MID:
            _kill_replica_1(self)
        return sent

    monkeypatch.setattr(SeparateGeneration, "next", next_step)
    monkeypatch.setattr(SeparateGeneration, "_send", send)
    try:
        return recorded_run(out, [*SEPARATE, f"rollout.replica_restarts={restarts}"])
    finally:
        monkeypatch.undo()


def test_dead_replicas_are_replaced_and_the_run_equals_the_uninterrupted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    uninterrupted = recorded_run(tmp_path / "uninterrupted", SEPARATE)
    with caplog.at_level(logging.WARNING, logger="geartrain.trainer"):
        restarted = _run_killing_replica_1(tmp_path / "restarted", monkeypatch, restarts=2)
    assert_reproduces_colocated(uninterrupted, restarted, STEPS, KEYS, "the uninterrupted run")
    counts = [r["separate/replica_restarts"] for r in restarted[0][1:]]
    assert counts == [0.0, 1.0, 2.0, 2.0], counts
    warnings = [r.getMessage() for r in caplog.records if "rollout replica" in r.getMessage()]
    assert len(warnings) == 2, warnings
    for text, left in zip(warnings, (1, 0), strict=True):
        assert text.startswith("rollout replica 1 died (role 'rollout' rank 1 of 2"), text
        assert f"starting a new one in its place (rollout.replica_restarts: {left} left)" in text, text


def test_a_death_with_no_restart_left_ends_the_run_naming_the_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(RankFailure) as failure:
        _run_killing_replica_1(tmp_path / "run", monkeypatch, restarts=1)
    text = str(failure.value) + "\n".join(getattr(failure.value, "__notes__", []))
    assert "role 'rollout' rank 1 of 2" in text and "died" in text, text
    assert "rollout.replica_restarts = 1: no restart left, 1 dead replica(s) replaced already" in text, text
