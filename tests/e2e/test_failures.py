"""What the trainer does with a reward function that raises, an over-long prompt and a
malformed dataset row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from e2e_helpers import MAIN_CONFIG, QUICK, run_geartrain
from geartrain.trainer import load_train_config, run_job
from geartrain.trainer.metrics import read_jsonl

pytestmark = pytest.mark.e2e

FAST = [o for o in QUICK if not o.startswith(("sft.", "trainer.total_steps"))] + [
    "sft.enabled=false",
    "trainer.total_steps=2",
    "trainer.plot=false",
    "trainer.progress=false",
    "data.batch_size=4",
    "sampling.n=4",
]


def _rows(n: int, start: int = 10) -> list[dict]:
    return [{"prompt": f"{a}+{a}=", "ground_truth": str(2 * a)} for a in range(start, start + n)]


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_raising_reward_function_scores_zero_and_the_run_goes_on(tmp_path: Path) -> None:
    reward = tmp_path / "flaky_reward.py"
    reward.write_text(
        "def score(response, ground_truth):\n"
        "    if int(ground_truth) % 4 == 0:\n"
        "        raise ValueError('cannot score this one')\n"
        "    return 1.0\n"
    )
    data = _write_jsonl(tmp_path / "train.jsonl", _rows(16))
    config = load_train_config(
        MAIN_CONFIG,
        [
            *FAST,
            f"data.path={data}",
            f"validation.path={data}",
            f"reward.function={reward}:score",
            f"trainer.output_dir={tmp_path / 'run'}",
        ],
    )
    result = run_job(config)
    assert result.steps == 2
    records = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["phase"] == "rl" and r["step"] > 0]
    assert len(records) == 2
    for record in records:
        # the rows whose ground truth is a multiple of 4 raised: their samples count as errors
        # every other sample scores 1, a failed one 0: the mean over the step's 4 x 4 samples
        # is exactly the share that did not fail
        assert record["reward/errors"] > 0
        assert record["reward/mean"] == 1.0 - record["reward/errors"] / 16


def test_over_long_prompt_is_dropped_and_counted(tmp_path: Path) -> None:
    data = _write_jsonl(tmp_path / "train.jsonl", [*_rows(12), {"prompt": "1+" * 40 + "1=", "ground_truth": "41"}])
    config = load_train_config(
        MAIN_CONFIG, [*FAST, f"data.path={data}", f"validation.path={data}", f"trainer.output_dir={tmp_path / 'run'}"]
    )
    run_job(config)
    first = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert first["step"] == 0 and first["data/filtered"] == 1.0 and first["data/prompts"] == 12.0


def test_prompt_budget_that_cannot_fit_the_rollout_is_a_config_error() -> None:
    from geartrain.errors import ConfigError

    with pytest.raises(ConfigError, match="exceeds rollout.max_model_len"):
        load_train_config(MAIN_CONFIG, ["data.max_prompt_length=40", "rollout.max_model_len=32"])


def test_malformed_row_stops_the_cli_with_the_file_and_line(tmp_path: Path) -> None:
    data = _write_jsonl(tmp_path / "train.jsonl", [*_rows(2), {"prompt": "1+1="}, *_rows(5, start=20)])
    proc = run_geartrain(
        "train", str(MAIN_CONFIG), *FAST, f"data.path={data}", f"trainer.output_dir={tmp_path / 'run'}"
    )
    assert proc.returncode == 2
    assert f"{data}, line 3" in proc.stderr and "ground_truth" in proc.stderr, proc.stderr[-2000:]
