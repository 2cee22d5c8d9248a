"""The second agentic job (examples/guess_number): an environment with feedback instead of
tools. Its rules are checked on their own, then inside the trainer: every sampled episode's
hints must agree with its secret, and its reward must say whether a guess hit it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from e2e_helpers import ROOT, run_geartrain

GUESS = ROOT / "examples" / "guess_number"
sys.path.insert(0, str(GUESS))

from env import GuessNumber, parse_guess  # noqa: E402
from task import hint_blind_trace, solved  # noqa: E402


def test_the_environment_hints_towards_the_secret_and_ends_on_it() -> None:
    env = GuessNumber()
    assert env.reset({"prompt": "guess:", "ground_truth": "6"}) == ""
    assert env.step("3;").observation == "+"
    assert env.step("8;").observation == "-"
    bad = env.step("x;")
    assert bad.observation == "?" and bad.info["invalid"] == 1 and not bad.done
    hit = env.step("6;")
    assert hit.done and hit.reward == 1.0 and hit.info["solved"] == 1
    assert parse_guess("7") == 7 and parse_guess("12;") is None
    with pytest.raises(ValueError, match="outside 1..9"):
        env.reset({"ground_truth": "0"})


def test_the_sft_traces_follow_the_rules_they_teach() -> None:
    import random

    rng = random.Random(0)
    for _ in range(50):
        secret = rng.randint(1, 9)
        trace = hint_blind_trace(secret, rng)
        turns = trace["turns"]
        assert turns[0]["role"] == "model" and turns[-1]["role"] == "model"
        for model, hint in zip(turns[::2], turns[1::2], strict=False):
            guess = parse_guess(model["text"])
            assert guess != secret and hint["text"] == ("+" if secret > guess else "-")
        assert len(turns[::2]) <= 4


def test_episodes_in_the_trainer_get_the_secret_s_hints_and_reward(tmp_path: Path) -> None:
    out = tmp_path / "guess"
    result = run_geartrain(
        "train",
        str(GUESS / "grpo.toml"),
        f"trainer.output_dir={out}",
        "sft.steps=40",
        "trainer.total_steps=2",
        "validation.every_n_steps=2",
        "trainer.log_completions=128",
        "trainer.export_hf=false",
        "trainer.tensorboard=false",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 2 * 16 * 8  # every episode of both steps
    multi_turn = 0
    for r in train:
        secret = int(r["ground_truth"])
        turns = r["turns"]
        guesses = [parse_guess(t["text"]) for t in turns if t["role"] == "model"]
        hints = [t["text"] for t in turns if t["role"] == "observation"]
        multi_turn += len(guesses) > 1
        assert 1 <= len(guesses) <= 4 and len(hints) in (len(guesses) - 1, len(guesses))
        for guess, hint in zip(guesses, hints, strict=False):
            expected = "?" if guess is None else ("+" if secret > guess else "-")
            assert hint == expected, r
        found = secret in guesses
        assert r["reward"] == float(found), r
        assert solved("", r["ground_truth"], meta={"episode": {"rewards": [float(found)]}})["score"] == float(found)
    assert multi_turn > len(train) // 4  # the hint-blind warm start plays several turns
