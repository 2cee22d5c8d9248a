"""``async def`` reward functions are awaited, as TRL's GRPOTrainer awaits them: per-sample
and batched (TRL's convention), in a run's scorer (with and without ``reward.timeout_s``),
from a thread that already runs an event loop (a notebook's), and in ``geartrain check``.
Before, a coroutine came back where a score was expected: refused with a RuntimeWarning
("coroutine ... was never awaited")."""

from __future__ import annotations

import asyncio
import warnings
from pathlib import Path

import pytest
from geartrain.rewards import RewardScorer
from test_reward_contract import _job, geartrain  # noqa: F401 - the fixture

RESPONSES, TRUTHS = ["4", "5", "6", "7"], ["4", "4", "6", "6"]


def exact(response: str, ground_truth: str) -> float:
    return float(response == ground_truth)


async def exact_async(response: str, ground_truth: str) -> float:
    await asyncio.sleep(0)  # a real suspension, as a call to a remote judge would make
    return float(response == ground_truth)


async def trl_exact_async(prompts, completions, ground_truth, **kwargs):  # noqa: ANN001, ANN003, ANN201
    await asyncio.sleep(0)
    return [float(c == t) + 0.5 * len(p) for p, c, t in zip(prompts, completions, ground_truth, strict=True)]


def trl_exact(prompts, completions, ground_truth, **kwargs):  # noqa: ANN001, ANN003, ANN201
    return [float(c == t) + 0.5 * len(p) for p, c, t in zip(prompts, completions, ground_truth, strict=True)]


class Judge:
    """A callable object whose ``__call__`` is ``async def``."""

    async def __call__(self, response: str, ground_truth: str) -> dict[str, float]:
        await asyncio.sleep(0)
        return {"score": float(response == ground_truth), "acc": float(response == ground_truth)}


@pytest.mark.parametrize("timeout_s", [None, 30.0])
@pytest.mark.parametrize(
    ("async_fn", "sync_fn"),
    [(exact_async, exact), (trl_exact_async, trl_exact), (Judge(), exact)],
    ids=["per-sample", "batched", "callable-object"],
)
def test_an_async_reward_scores_as_its_plain_twin(async_fn, sync_fn, timeout_s) -> None:  # noqa: ANN001
    prompts = ["a", "bb", "a", "bb"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" fails the test
        got = RewardScorer(async_fn, timeout_s=timeout_s).score(RESPONSES, TRUTHS, prompts=prompts)
    want = RewardScorer(sync_fn, timeout_s=timeout_s).score(RESPONSES, TRUTHS, prompts=prompts)
    assert got.errors == [] and got.scores.tolist() == want.scores.tolist()
    assert want.scores.tolist() != [0.0] * 4  # the comparison means something


def test_an_async_reward_is_awaited_from_a_thread_that_runs_an_event_loop() -> None:
    async def inside_a_loop() -> list[float]:
        return RewardScorer(exact_async).score(RESPONSES, TRUTHS).scores.tolist()

    assert asyncio.run(inside_a_loop()) == [1.0, 0.0, 1.0, 0.0]


def test_check_calls_an_async_reward(geartrain, tmp_path: Path) -> None:  # noqa: ANN001, F811
    body = "import asyncio\nasync def score(response, ground_truth):\n    await asyncio.sleep(0)\n    return 0.5\n"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        proc = geartrain("check", str(_job(tmp_path, body, '[reward]\nfunction = "reward.py:score"\n')), "--no-plugins")
    assert proc.returncode == 0, proc.stderr
    assert "coroutine" not in proc.stdout + proc.stderr
