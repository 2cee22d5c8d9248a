"""A batch's reward result carried one sample at a time (``RewardResult.rows`` /
``from_rows``), as the reward workers of ``reward.workers`` return their shares, and the
config's rules for those workers."""

from __future__ import annotations

from pathlib import Path

import pytest
from geartrain.errors import ConfigError
from geartrain.rewards import RewardResult, RewardScorer, correctness, make_term
from geartrain.trainer.config import load_train_config

JOB = Path(__file__).resolve().parents[2] / "examples" / "arithmetic" / "grpo.toml"


def fmt(response: str, ground_truth: str) -> dict[str, float]:
    if response == "boom":
        raise RuntimeError("boom")
    return {"score": 0.1 * len(response), "acc": float(response == ground_truth)}


def exact(response: str, ground_truth: str) -> float:
    return 1.0 / 3.0 if response == ground_truth else 0.0


def _result() -> RewardResult:
    scorer = RewardScorer([make_term(fmt, name="fmt", weight=0.5), make_term(exact, name="exact")])
    responses = ["12", "boom", "7", "12", "x", "3"]
    return scorer.score(responses, ["12", "1", "7", "4", "x", "0"])


def test_rows_round_trip_keeps_scores_terms_errors_and_metrics() -> None:
    result = _result()
    # 'fmt' fails on sample 1, which 'exact' still scores (issue 35 item 8): a term's error, not the sample's
    assert result.errors == [] and result.term_errors == {"fmt": [1]} and len(result.term_scores) == 2
    again = RewardResult.from_rows(result.rows())
    assert again.scores.tolist() == result.scores.tolist()
    assert (again.errors, again.term_scores, again.extras, again.term_errors) == (
        result.errors,
        result.term_scores,
        result.extras,
        result.term_errors,
    )
    assert again.metrics == result.metrics
    assert correctness(again) == correctness(result) == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]


def test_shares_gathered_in_order_summarise_the_whole_batch() -> None:
    result = _result()
    rows = result.rows()
    first, second = RewardResult.from_rows(rows[:3]), RewardResult.from_rows(rows[3:])
    whole = RewardResult.from_rows(first.rows() + second.rows())
    assert whole.metrics == result.metrics  # errors and means over all samples, not one share's
    assert first.metrics["reward/fmt/errors"] == 1.0 and "reward/fmt/errors" not in second.metrics


def test_reward_workers_need_ray_and_no_reward_model() -> None:
    with pytest.raises(ConfigError, match=r"reward\.workers.*cluster\.placement"):
        load_train_config(JOB, ["reward.workers=2"], check_plugins=False)
    assert (
        load_train_config(JOB, ["reward.workers=2", "cluster.placement=ray"], check_plugins=False).reward.workers == 2
    )


def test_a_score_that_is_not_finite_is_never_a_correct_answer() -> None:
    """Probes7 (issue 35, case 47): a reward of 1e300 (inf in float32) read as correct, so
    the SFT warm start's dev accuracy was "100.0 %" and it stopped early on a broken reward."""
    import torch

    scores = torch.tensor([1e300, 1.0, -1e300, float("nan"), 0.0, 0.5], dtype=torch.float32)
    assert correctness(RewardResult(scores=scores)) == [0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
