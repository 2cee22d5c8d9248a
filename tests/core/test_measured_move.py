"""``geartrain.memory.measured_move``: the release/resume measurement every rollout shares."""

from __future__ import annotations

from geartrain.memory import device_memory_in_use, measured_move


def test_move_runs_between_two_readings_with_its_detail() -> None:
    held = [1000]
    calls: list[str] = []

    def release() -> dict[str, int]:
        calls.append("release")
        held[0] = 400
        return {"kv_cache": 600}

    stats = measured_move(lambda: held[0], release, done=False)
    assert calls == ["release"]
    assert (stats.before, stats.after, stats.freed, stats.detail) == (1000, 400, 600, {"kv_cache": 600})
    assert stats.seconds >= 0.0


def test_nothing_runs_when_already_in_the_target_state() -> None:
    def move() -> None:
        raise AssertionError("a released rollout must not be released again")

    stats = measured_move(lambda: 123, move, done=True)
    assert (stats.before, stats.after, stats.seconds, stats.detail) == (123, 123, 0.0, {})


def test_cpu_memory_comes_from_the_callers_measure() -> None:
    assert device_memory_in_use("cpu", lambda: 42) == 42
