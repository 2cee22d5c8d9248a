"""What ``run_job`` checks of what Python hands it (issue 35, round 13): a config changed after
it was built is checked again as a whole (assignment checks only the one field: a mutated
``mini_batches`` ran a step that never finished; GRPO with ``n = 1`` and a stale schedule ran
silently), and rewards that are no functions or weights that are no finite numbers are named."""

from __future__ import annotations

from pathlib import Path

import pytest
from geartrain.errors import ConfigError
from geartrain.testing.fakes import FakeBackends, write_fake_job
from geartrain.trainer import load_train_config, run_job


def _config(tmp_path: Path):  # noqa: ANN202 - a TrainConfig
    job = write_fake_job(tmp_path, tmp_path / "run", "total_steps = 2\nprogress = false\nexport_hf = false\n")
    return load_train_config(job)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda c: setattr(c.algorithm, "mini_batches", 100000), "algorithm.mini_batches (100000) exceeds the samples"),
        (lambda c: setattr(c.sampling, "n", 1), "with sampling.n = 1 it would train with no baseline at all"),
    ],
    ids=["mini-batches", "grpo-without-a-group"],
)
def test_a_config_changed_after_it_was_built_is_checked_again(
    fakes: FakeBackends, tmp_path: Path, change, said: str
) -> None:
    config = _config(tmp_path)
    change(config)
    with pytest.raises(ConfigError) as info:
        run_job(config)
    assert said in str(info.value), str(info.value)
    assert "the TrainConfig given to run_job (changed after it was built?)" in str(info.value)
    assert not (tmp_path / "run").exists(), "nothing may be written before the config is checked"


def test_a_changed_step_count_derives_the_schedule_again(fakes: FakeBackends, tmp_path: Path) -> None:
    config = _config(tmp_path)
    config.trainer.total_steps = 3  # the optimizer's total_steps was derived from 2 when it was built
    result = run_job(config)
    assert result.steps == 3


@pytest.mark.parametrize(
    ("reward_fn", "weights", "said"),
    [
        (123, None, "reward_fn: 123 (int) is neither a function nor a 'file.py:name' spec"),
        ([len, None], None, "reward_fn[1]: None (NoneType) is neither a function nor a 'file.py:name' spec"),
        ([len, len], [1.0, float("nan")], "reward_weights[1]: nan is not a finite number"),
    ],
    ids=["an-int", "none-in-a-list", "a-nan-weight"],
)
def test_rewards_that_are_no_functions_and_weights_that_are_no_numbers_are_named(
    fakes: FakeBackends, tmp_path: Path, reward_fn, weights, said: str
) -> None:
    with pytest.raises(ConfigError) as info:
        run_job(_config(tmp_path), reward_fn=reward_fn, reward_weights=weights)
    problems = str(info.value).split("problem(s)\n", 1)[1].strip().splitlines()
    assert problems == [f"  {said}"] or problems == [said], str(info.value)


def test_a_second_job_in_the_same_process_while_one_runs_is_refused(fakes: FakeBackends, tmp_path: Path) -> None:
    """Issue 35, round 15: two run_job calls in threads of one process (a notebook sweep) both
    "succeeded", neither equal to the same job run alone (they share the process's random
    generators and torch state), without a word."""
    import threading

    from geartrain.errors import GeartrainError

    started, release = threading.Event(), threading.Event()

    def waits(response: str, ground_truth: str) -> float:
        started.set()
        release.wait(timeout=600)  # a hang guard only: the test releases it
        return 1.0

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = _config(tmp_path / "a")
    outcome: list[object] = []
    worker = threading.Thread(target=lambda: outcome.append(run_job(first, reward_fn=waits)))
    worker.start()
    try:
        assert started.wait(timeout=600)
        with pytest.raises(GeartrainError, match="another job is running in this process"):
            run_job(_config(tmp_path / "b"))
    finally:
        release.set()
        worker.join(timeout=600)
    assert outcome and getattr(outcome[0], "steps", None) == 2
    assert run_job(_config(tmp_path / "b")).steps == 2  # one after another: fine
