"""Completions you can read (issue 19, item 5): ``trainer.log_completions`` writes sampled
episodes of each step with every reward function's value and the advantage, and the greedy
validation outputs, to completions.jsonl and TensorBoard; ``sampling.stop`` strings end
samples."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import MAIN_CONFIG
from geartrain.trainer import load_train_config, run_job

DIGITS = [str(d) for d in range(10)]


def _run(tmp_path: Path, second: str, *overrides: str) -> tuple[Path, Any]:
    """The main job for 3 steps without SFT, 4 completions logged a step, rewarded by
    ``exact_match`` and ``second`` (a ``[[reward.functions]]`` entry's inner text); its
    output directory and config."""
    out = tmp_path / "run"
    config = load_train_config(
        MAIN_CONFIG,
        [
            "sft.enabled=false",
            "trainer.progress=false",
            "trainer.export_hf=false",
            "trainer.plot=false",
            "trainer.total_steps=3",
            "validation.every_n_steps=0",
            "validation.max_prompts=4",
            "trainer.log_completions=4",
            "reward.function=''",
            f'reward.functions=[{{name = "exact", function = "task.py:exact_match"}}, {{{second}}}]',
            *overrides,
            f"trainer.output_dir={out}",
        ],
        check_plugins=False,
    )
    run_job(config)
    return out, config


def test_completions_jsonl_with_each_reward_and_stop_strings(tmp_path: Path) -> None:
    (tmp_path / "r.py").write_text(
        "def brevity(prompts, completions):\n    return [-float(len(c)) for c in completions]\n"
    )
    out, config = _run(
        tmp_path,
        f'name = "short", function = "{tmp_path / "r.py"}:brevity", weight = 0.1',
        f"sampling.stop={json.dumps(DIGITS)}",
    )
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "validation"]
    assert [r["step"] for r in train] == [1] * 4 + [2] * 4 + [3] * 4
    assert [r["step"] for r in val] == [0] * 4 + [3] * 4
    for r in train + val:
        assert set(r["rewards"]) == {"exact", "short"}
        assert r["reward"] == pytest.approx(r["rewards"]["exact"] + 0.1 * r["rewards"]["short"])
        assert r["rewards"]["short"] == -len(r["response"])
        assert r["prompt"].endswith("=") and isinstance(r["ground_truth"], str)
        # a stop string ends the sample: no digit before its last character
        assert not any(c in DIGITS for c in r["response"][:-1]), r["response"]
    assert all(isinstance(r["advantage"], float) for r in train) and "advantage" not in val[0]
    assert any(r["response"][-1:] in DIGITS and len(r["response"]) < config.sampling.max_tokens for r in train + val)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("reward/exact/mean" in m and "reward/short/mean" in m for m in metrics if m["step"] >= 1)
    assert not any(k.startswith("samples/reward") for m in metrics for k in m)
    # one accuracy per step, reward/accuracy (the function's acc extra is not repeated as reward/acc)
    assert all("reward/accuracy" in m and "reward/acc" not in m for m in metrics if m["step"] >= 1)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert {"completions/train/text_summary", "completions/validation/text_summary"} <= set(events.Tags()["tensors"])


PROGRESS = """
def progress(completions, trainer_state, completion_ids, log_metric, log_extra, **kwargs):
    log_metric("step_seen", float(trainer_state.global_step))
    log_extra("n_ids", [len(ids) for ids in completion_ids])
    log_extra("of", [trainer_state.max_steps] * len(completions))
    return [float(trainer_state.global_step) for _ in completions]
"""


def test_trls_run_time_reward_keywords(tmp_path: Path) -> None:
    """TRL passes reward functions ``trainer_state`` (shaping by progress),
    ``completion_ids``, ``log_metric`` and ``log_extra``; one that uses them ran into a
    missing argument."""
    (tmp_path / "r.py").write_text(PROGRESS)
    out, config = _run(tmp_path, f'name = "progress", function = "{tmp_path / "r.py"}:progress", weight = 0.0')
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1] * 4 + [2] * 4 + [3] * 4
    for r in train:
        assert r["rewards"]["progress"] == r["step"]  # trainer_state.global_step: the step scored
        assert r["columns"]["of"] == 3  # trainer_state.max_steps
        # completion_ids: the response's tokens (one per character of the char tokenizer; the
        # special ones the text leaves out, EOS among them, too)
        assert len(r["response"]) <= r["columns"]["n_ids"] <= config.sampling.max_tokens, r
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m["step"] >= 1 and "reward/step_seen" in m]
    assert [m["reward/step_seen"] for m in steps] == [1.0, 2.0, 3.0]
