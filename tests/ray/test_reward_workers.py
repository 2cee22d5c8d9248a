"""``reward.workers = N``: rule reward functions on N Ray actors of their own.

* Scoring a batch on 2 workers gives the driver's scores, accuracy, per-term rows and
  metrics (errors counted over the whole batch, not one worker's share), in the batch's
  order, and each worker scored a share in a process of its own.
* A short job with 2 reward workers trains exactly as the job scoring in the driver.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from geartrain.batch import Batch
from geartrain.cluster import Dispatch, make_placement
from geartrain.rewards import RewardResult, RewardScorer, correctness
from geartrain.trainer.config import ClusterConfig, RankResources, load_train_config
from geartrain.trainer.roles import RewardWorker
from geartrain.trainer.run import run_job
from geartrain.user_code import load_from_file
from ray_helpers import MAIN_CONFIG, SHORT, records

pytestmark = [pytest.mark.slow]

HERE = Path(__file__).resolve().parent
REWARD = f"{HERE / 'reward_fns.py'}:pid_reward"
STEPS = 3


def _batch(rows: int = 24) -> Batch:
    texts = [f"{(i * 7) % 19}" for i in range(rows)]  # some start with '7': those raise
    truths = [f"{(i * 5) % 19}" for i in range(rows)]
    return Batch(
        meta={
            "response_text": texts,
            "ground_truth": truths,
            "prompt": [f"q{i}" for i in range(rows)],
            "data_meta": [{} for _ in range(rows)],
            "uid": [i // 4 for i in range(rows)],
        },
        batch_size=rows,
    )


def test_two_workers_score_like_the_driver() -> None:
    function = load_from_file(REWARD, None, what="reward function", key="reward.function")
    batch = _batch()
    expected = RewardScorer(function).score(
        batch["response_text"], batch["ground_truth"], prompts=batch["prompt"], metas=batch["data_meta"]
    )
    assert expected.errors, "no failing sample: the error counts would not be compared"
    placement = make_placement(ClusterConfig(placement="ray", resources_per_rank=RankResources(cpus=0.5)))
    try:
        group = placement.group("reward", RewardWorker, function, None, None, world_size=2, pool="reward")
        got = RewardResult.from_rows(group.call("score", batch, dispatch=Dispatch.DP))
    finally:
        placement.close()
    # the ranks' temporary log directory (no log_dir given, no error quoted it) is gone with it
    assert not placement.log_dir.exists(), sorted(placement.log_dir.iterdir())  # type: ignore[attr-defined]
    assert torch.equal(got.scores, expected.scores)
    assert correctness(got) == correctness(expected)
    assert got.errors == expected.errors and got.term_scores == expected.term_scores
    pids = {p for p in got.extras["pid"] if p is not None}
    assert len(pids) == 2 and os.getpid() not in pids, pids  # two worker processes, not the driver
    expected_metrics = {k: v for k, v in expected.metrics.items() if k != "reward/pid"}
    assert {k: v for k, v in got.metrics.items() if k != "reward/pid"} == expected_metrics


def _job(out: Path, *extra: str) -> list[dict]:
    config = load_train_config(
        MAIN_CONFIG,
        [
            *SHORT,
            f"trainer.total_steps={STEPS}",
            "trainer.save_every=0",
            "cluster.placement=ray",
            f"reward.function={REWARD}",
            f"trainer.output_dir={out}",
            *extra,
        ],
    )
    run_job(config)
    return records(out / "metrics.jsonl")


def test_job_with_reward_workers_trains_as_the_driver_scoring(tmp_path: Path) -> None:
    driver = _job(tmp_path / "driver")
    workers = _job(tmp_path / "workers", "reward.workers=2", "reward.resources_per_worker={cpus=0.5}")
    assert len(driver) == len(workers) == STEPS + 1
    assert any(r["actor/grad_norm"] > 0 for r in driver[1:]), "no gradient: the comparison would be empty"
    # the extra 'pid' is the mean process id that scored: the driver's, or two workers'
    assert all(r["reward/pid"] == os.getpid() for r in driver[1:])
    assert all(r["reward/pid"] != os.getpid() for r in workers[1:])
    for a, b in zip(driver[1:], workers[1:], strict=True):
        for key in ("reward/mean", "reward/errors", "reward/accuracy", "actor/pg_loss", "actor/grad_norm"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
