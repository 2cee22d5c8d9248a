"""Issue 24, item 6: the messages a user gets for bad input say what is wrong, not
something else: scores that are not finite or too large are named as such (not "lower the
learning rate"), a group-baseline estimator with ``sampling.n = 1`` is refused, a
whitespace-only prompt is refused naming its row, and characters outside the tokenizer are
counted and warned about once."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from geartrain import ConfigError, DataError
from geartrain.batch import Batch
from geartrain.data import DataConfig, PromptDataset
from geartrain.testing import tiny_tokenizer
from geartrain.trainer import load_train_config
from geartrain.trainer.step_metrics import reward_metrics
from geartrain.trainer.watchdog import TrainingStalledError, Watchdog, WatchdogConfig

ROOT = Path(__file__).resolve().parents[2]
MAIN_CONFIG = ROOT / "examples" / "arithmetic" / "grpo.toml"


def _skipping_step(scores: list[float]) -> dict[str, float]:
    """The metrics of a step whose optimizer step was skipped, with these scores."""
    batch = Batch({"score": torch.tensor(scores), "correct": torch.zeros(len(scores))})
    return {"actor/skipped": 1.0, "actor/grad_norm": float("nan"), "actor/lr": 3e-4, **reward_metrics(batch)}


@pytest.mark.parametrize(("score", "said"), [(1e300, "not finite"), (float("nan"), "not finite"), (-1e20, "too large")])
def test_the_watchdog_names_scores_that_overflow_not_the_learning_rate(
    score: float, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    dog = Watchdog(WatchdogConfig(max_skipped_steps=2))
    with caplog.at_level(logging.WARNING, logger="geartrain.watchdog"):
        dog.observe(1, _skipping_step([0.5, score, 0.0]))
        with pytest.raises(TrainingStalledError) as err:
            dog.observe(2, _skipping_step([score, 1.0, 0.0]))
    message = str(err.value)
    assert f"the reward scores are {said}" in message and "fix the reward function" in message
    assert "Lower actor.engine.optim.lr" not in message and "the learning rate is not the cause" in message
    warned = [r.getMessage() for r in caplog.records if r.name == "geartrain.watchdog"]
    assert len(warned) == 1 and f"step 1: the reward scores are {said}" in warned[0]  # once, at the first such step


def test_a_run_shorter_than_the_streak_that_trained_nothing_ends_with_the_error() -> None:
    """Probes rerun (issue 35): a reward returning 1e300 in a 2-step job warned, skipped both
    optimizer steps and ended with exit 0, having trained nothing."""
    dog = Watchdog(WatchdogConfig(max_skipped_steps=3))
    dog.observe(1, _skipping_step([1e300, 1.0, 0.0]))
    dog.observe(2, _skipping_step([1e300, 1.0, 0.0]))
    with pytest.raises(TrainingStalledError) as err:
        dog.finish()
    message = str(err.value)
    assert "step 2: all 2 steps of this run (nothing was trained) skipped every optimizer step" in message, message
    assert "the reward scores are not finite" in message and "fix the reward function" in message


def test_a_run_that_trained_a_step_or_has_the_watchdog_off_ends_normally() -> None:
    trained = {"actor/skipped": 0.0, "actor/grad_norm": 1.0, "actor/lr": 3e-4}
    dog = Watchdog(WatchdogConfig(max_skipped_steps=3))
    dog.observe(1, trained)
    dog.observe(2, _skipping_step([0.5, 1.0, 0.0]))
    dog.finish()
    off = Watchdog(WatchdogConfig(max_skipped_steps=0))
    off.observe(1, _skipping_step([0.5, 1.0, 0.0]))
    off.finish()
    Watchdog(WatchdogConfig()).finish()  # no step at all (a resumed finished run)


def test_a_short_run_whose_every_reward_call_failed_ends_with_the_error() -> None:
    dog = Watchdog(WatchdogConfig(max_failed_reward_steps=3))
    failed = {"reward/error_fraction": 1.0, "reward/errors": 4.0, "reward/timeouts": 0.0}
    dog.observe(1, failed)
    dog.observe(2, failed)
    with pytest.raises(TrainingStalledError, match="every reward call of all 2 steps of this run failed"):
        dog.finish()


def test_a_short_run_whose_every_episode_failed_ends_with_the_error() -> None:
    """Probe rerun for issue 35 item 7: a 2-step agent job whose environment's ``step`` is
    ``async def`` (every episode an error: 'step returned coroutine') warned and exited 0."""
    dog = Watchdog(WatchdogConfig(max_failed_episode_steps=3))
    failed = {"agent/env_error_fraction": 1.0, "agent/env_errors": 4.0}
    dog.observe(1, failed)
    dog.observe(2, failed)
    with pytest.raises(
        TrainingStalledError, match="every episode of all 2 steps of this run ended with an environment"
    ):
        dog.finish()
    some = Watchdog(WatchdogConfig(max_failed_episode_steps=3))
    some.observe(1, failed)
    some.observe(2, {"agent/env_error_fraction": 0.5, "agent/env_errors": 2.0})
    some.finish()
    off = Watchdog(WatchdogConfig(max_failed_episode_steps=0))
    off.observe(1, failed)
    off.finish()


def test_a_real_lr_overflow_still_gets_the_learning_rate_advice() -> None:
    dog = Watchdog(WatchdogConfig(max_skipped_steps=1))
    with pytest.raises(TrainingStalledError, match="Lower actor.engine.optim.lr"):
        dog.observe(1, _skipping_step([0.5, 1.0, 0.0]))


def test_reward_metrics_max_abs() -> None:
    assert (
        reward_metrics(Batch({"score": torch.tensor([0.5, -2.0]), "correct": torch.tensor([0.0, 1.0])}))[
            "reward/max_abs"
        ]
        == 2.0
    )
    scores = torch.tensor([1e300])  # a float32 score tensor holds inf
    assert reward_metrics(Batch({"score": scores, "correct": torch.zeros(1)}))["reward/max_abs"] == float("inf")


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline"])
def test_a_group_baseline_with_one_sample_is_refused(advantage: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_train_config(MAIN_CONFIG, ["sampling.n=1", f"algorithm.advantage={advantage}"], check_plugins=False)
    assert f"algorithm.advantage = '{advantage}' takes its baseline from the other samples of the same prompt" in str(
        err.value
    )
    assert "sampling.n = 1 it would train with no baseline" in str(err.value)


def test_an_estimator_without_a_group_runs_with_one_sample() -> None:
    config = load_train_config(
        MAIN_CONFIG, ["sampling.n=1", "algorithm.advantage=reinforce_plus_plus"], check_plugins=False
    )
    assert config.sampling.n == 1


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("row", "said"),
    [
        ({"prompt": " \t\n ", "answer": "1"}, "'prompt' is only whitespace"),
        (
            {"messages": [{"role": "user", "content": "  "}], "answer": "1"},
            "every message of 'messages' is empty or whitespace",
        ),
    ],
    ids=["prompt", "messages"],
)
def test_a_whitespace_only_prompt_is_refused_with_its_row(tmp_path: Path, row: dict, said: str) -> None:
    path = _jsonl(tmp_path / "train.jsonl", [{"prompt": "1+2=", "answer": "3"}, row])
    with pytest.raises(DataError) as err:
        PromptDataset(str(path), tiny_tokenizer(), DataConfig(ground_truth_key="answer"))
    assert str(err.value).startswith(f"{path}, line 2: {said}"), str(err.value)


def test_characters_outside_the_tokenizer_are_counted_and_warned_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "1+2=é", "answer": "3"}, {"prompt": "ß 4+ß=", "answer": "4"}]
    path = _jsonl(tmp_path / "train.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="geartrain.data"):
        dataset = PromptDataset(str(path), tiny_tokenizer(), DataConfig(ground_truth_key="answer"))
    assert len(dataset) == 3
    warned = [r.getMessage() for r in caplog.records if r.name == "geartrain.data"]
    assert len(warned) == 1, warned
    assert "3 character(s) in 2 prompt(s) are not in the tokenizer's vocabulary and become <unk>" in warned[0]
    assert f"'é' ({path}, line 2)" in warned[0] and f"'ß' ({path}, line 3)" in warned[0]


def test_prompts_the_tokenizer_covers_warn_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _jsonl(tmp_path / "train.jsonl", [{"prompt": "1+2=", "answer": "3"}])
    with caplog.at_level(logging.WARNING, logger="geartrain.data"):
        PromptDataset(str(path), tiny_tokenizer(), DataConfig(ground_truth_key="answer"))
    assert not [r for r in caplog.records if r.name == "geartrain.data"]
