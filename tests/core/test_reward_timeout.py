"""A reward function that hangs or raises does not hang or flood the run (issue 10, item 6),
and the watchdogs' streak counting (item 5; the runs themselves: tests/e2e/test_reliability.py)."""

from __future__ import annotations

import logging
import threading

import pytest
from geartrain.rewards import RewardScorer, make_term, probe_term
from geartrain.trainer.watchdog import TrainingStalledError, Watchdog, WatchdogConfig


def test_a_hanging_reward_times_out_per_batch_scores_zero_and_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    release, returned = threading.Event(), threading.Event()

    def hangs_on_the_third(response: str, ground_truth: str) -> float:
        if response == "hang":
            release.wait()  # until the test releases it (a daemon thread: no clock of its own)
            returned.set()
        return 1.0

    scorer = RewardScorer(hangs_on_the_third, timeout_s=0.5)
    try:
        with caplog.at_level(logging.WARNING, logger="geartrain.rewards"):
            out = scorer.score(["a", "b", "hang", "c"], ["x"] * 4)
            # the batch ended at its timeout while the hung call still runs, not when it returned
            # (an order of events, not a wall-clock limit: a loaded machine cannot fail it)
            assert not returned.is_set()
            again = scorer.score(["hang", "a"], ["x"] * 2)
            assert not returned.is_set()
    finally:
        release.set()
    assert out.scores.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert out.metrics["reward/timeouts"] == 2.0 and out.metrics["reward/errors"] == 2.0
    assert out.metrics["reward/error_fraction"] == 0.5 and out.errors == [2, 3]
    assert again.metrics["reward/timeouts"] == 2.0 and again.metrics["reward/error_fraction"] == 1.0
    warned = [r.getMessage() for r in caplog.records if r.name == "geartrain.rewards"]
    assert len(warned) == 1, warned  # the first timeout is logged, the second only counted
    assert "timed out: reward.timeout_s = 0.5s for the batch ran out at sample 2 of 4" in warned[0]


def test_the_start_up_probe_of_a_hanging_reward_ends_at_the_timeout_with_a_note() -> None:
    """The check before step 1 calls the reward on a few rows within ``reward.timeout_s``
    too: a function that hangs is a note (a run scores such samples 0), not a hang."""
    release, returned = threading.Event(), threading.Event()

    def hangs_on_two(response: str, ground_truth: str) -> float:
        if ground_truth == "2":
            release.wait()  # until the test releases it (a daemon thread: no clock of its own)
            returned.set()
        return 1.0

    rows = ["1", "2", "3"]
    notes: list[str] = []
    try:
        problem = probe_term(
            make_term(hangs_on_two), rows, rows, ["p"] * 3, [{}] * 3, [f"row {r}" for r in rows], notes, timeout_s=0.5
        )
        assert not returned.is_set()  # the probe ended while the hung call still runs
    finally:
        release.set()
    assert problem is None, problem  # what a run tolerates does not stop the job
    assert notes == [
        "reward 'hangs_on_two' did not return within reward.timeout_s = 0.5 s (probed rows from row 1; the call "
        "on row 2 was abandoned): a run scores such samples 0 and counts them (reward/timeouts); raise "
        "reward.timeout_s if the function is only slow"
    ]


def test_a_raising_reward_logs_its_traceback_once_per_run(caplog: pytest.LogCaptureFixture) -> None:
    def broken(response: str, ground_truth: str) -> float:
        raise KeyError("no such field")

    scorer = RewardScorer(broken, timeout_s=60)
    with caplog.at_level(logging.WARNING, logger="geartrain.rewards"):
        results = [scorer.score(["a", "b"], ["x", "y"]) for _ in range(5)]
    assert [r.metrics["reward/errors"] for r in results] == [2.0] * 5
    records = [r for r in caplog.records if r.name == "geartrain.rewards"]
    with_traceback = [r for r in records if r.exc_info]
    assert len(with_traceback) == 1 and "KeyError" in with_traceback[0].getMessage()
    assert len(records) == 2  # the traceback, then "failed on 2 of 2 samples"; later steps only count


def test_no_timeout_scores_in_the_callers_thread() -> None:
    seen: list[str] = []
    scorer = RewardScorer(lambda response, ground_truth: seen.append(threading.current_thread().name) or 1.0)
    assert scorer.score(["a"], ["b"]).metrics["reward/timeouts"] == 0.0
    assert seen == [threading.current_thread().name]


# ----------------------------------------------------------------------------- watchdog

OK = {"actor/skipped": 0.0, "advantages/abs_mean": 0.3, "reward/error_fraction": 0.0, "reward/std": 0.5}


def test_consecutive_skipped_steps_stop_the_run_after_k() -> None:
    dog = Watchdog(WatchdogConfig(max_skipped_steps=3))
    skipped = {**OK, "actor/skipped": 1.0, "actor/grad_norm": float("inf"), "actor/lr": 1e37}
    for step, metrics in enumerate([skipped, skipped, OK, skipped, skipped], start=1):
        dog.observe(step, metrics)  # a finite step in between resets the streak
    with pytest.raises(TrainingStalledError, match="the last 3 steps skipped every optimizer step") as err:
        dog.observe(6, skipped)
    assert "actor.engine.optim.lr" in str(err.value) and "watchdog.max_skipped_steps" in str(err.value)


def test_all_zero_advantages_warn_once_per_streak_naming_the_cause(caplog: pytest.LogCaptureFixture) -> None:
    dog = Watchdog(WatchdogConfig(zero_advantage_steps=2), temperature=0.0, n=8)
    flat = {**OK, "advantages/abs_mean": 0.0, "reward/std": 0.2}
    with caplog.at_level(logging.WARNING, logger="geartrain.watchdog"):
        for step in range(1, 6):
            dog.observe(step, flat)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "all zero for the last 2 steps (through step 2)" in warned[0]
    assert "sampling.temperature = 0 makes the 8 samples of a prompt identical" in warned[0]


def test_steps_whose_rewards_all_failed_warn_then_stop(caplog: pytest.LogCaptureFixture) -> None:
    dog = Watchdog(WatchdogConfig(max_failed_reward_steps=2))
    failed = {**OK, "reward/error_fraction": 1.0, "reward/errors": 8.0, "reward/timeouts": 0.0}
    with caplog.at_level(logging.WARNING, logger="geartrain.watchdog"):
        dog.observe(1, failed)
    assert "every reward call of step 1 failed or timed out (8 errors, 0 timeouts)" in caplog.records[0].getMessage()
    with pytest.raises(TrainingStalledError, match="for 2 steps in a row"):
        dog.observe(2, failed)


def test_zero_turns_a_watchdog_off() -> None:
    dog = Watchdog(WatchdogConfig(max_skipped_steps=0, max_failed_reward_steps=0))
    for step in range(1, 10):
        dog.observe(step, {**OK, "actor/skipped": 1.0, "reward/error_fraction": 1.0})


def test_steps_whose_episodes_all_failed_warn_then_stop(caplog: pytest.LogCaptureFixture) -> None:
    dog = Watchdog(WatchdogConfig(max_failed_episode_steps=2))
    failed = {**OK, "agent/env_error_fraction": 1.0, "agent/env_errors": 16.0}
    with caplog.at_level(logging.WARNING, logger="geartrain.watchdog"):
        dog.observe(1, {**failed, "agent/env_error_fraction": 0.5})  # some episodes ran: no streak
        dog.observe(2, failed)
    assert len(caplog.records) == 1
    assert "every episode of step 2 ended with an environment error (16 episodes)" in caplog.records[0].getMessage()
    with pytest.raises(TrainingStalledError, match="for 2 steps in a row; fix the environment"):
        dog.observe(3, failed)
