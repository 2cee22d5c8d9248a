"""Issue 35, item 8: one failing reward function of several is named and the others still
score the sample (it was reward 0 for the sample, and the warning blamed ``good+bad``); a
function that returns ``None`` for every sample says so (it was silent)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from geartrain.rewards import RewardResult, RewardScorer, make_term
from test_reward_contract import _job, geartrain  # noqa: F401 - the fixture


def good(response: str, ground_truth: str) -> float:
    return float(response == ground_truth)


def bad(response: str, ground_truth: str) -> float:
    raise KeyError("judge_url")


def never(completions: list[str], **kwargs: Any) -> list[float | None]:
    return [None] * len(completions)


def test_one_failing_function_of_several_is_named_and_the_others_still_score(caplog: Any) -> None:
    scorer = RewardScorer([make_term(good, name="good"), make_term(bad, name="bad", weight=2.0)])
    with caplog.at_level(logging.WARNING, logger="geartrain.rewards"):
        result = scorer.score(["4", "5", "4"], ["4", "4", "4"])
    assert result.scores.tolist() == [1.0, 0.0, 1.0]  # good's scores: bad is left out, not the sample
    assert result.errors == [] and result.metrics["reward/errors"] == 0.0
    assert result.metrics["reward/bad/errors"] == 3.0 and "reward/good/errors" not in result.metrics
    assert result.term_scores == {"good": [1.0, 0.0, 1.0], "bad": [None, None, None]}
    text = caplog.text
    assert "reward function bad failed on sample 0 (left out of the sample's reward, the other functions" in text
    assert "KeyError: 'judge_url'" in text
    assert "reward function bad failed on 3 of 3 samples (rows [0, 1, 2]); the other functions scored them" in text
    assert "good+bad" not in text
    # across reward workers (rows), the count survives
    assert RewardResult.from_rows(result.rows()).metrics["reward/bad/errors"] == 3.0


def test_a_sample_no_function_scores_is_still_a_counted_failure_named_by_the_one_that_failed(caplog: Any) -> None:
    scorer = RewardScorer([make_term(bad, name="bad"), make_term(never, name="never")])
    with caplog.at_level(logging.WARNING, logger="geartrain.rewards"):
        result = scorer.score(["4"], ["4"])
    assert result.errors == [0] and result.scores.tolist() == [0.0]
    assert "reward function bad failed on sample 0 (reward 0;" in caplog.text


def test_a_function_that_never_scores_says_so_once(caplog: Any) -> None:
    scorer = RewardScorer([make_term(good, name="good"), make_term(never, name="never")])
    with caplog.at_level(logging.WARNING, logger="geartrain.rewards"):
        scorer.score(["4", "5"], ["4", "4"])
        scorer.score(["4", "5"], ["4", "4"])
    said = [r.getMessage() for r in caplog.records if "returned None for every one" in r.getMessage()]
    assert said == [
        "reward function never returned None for every one of the 2 samples of this batch: it scores nothing "
        "(None leaves a function out of a sample's reward); said once"
    ]


def test_check_notes_a_function_that_returned_none_on_every_probed_row(geartrain, tmp_path: Path) -> None:  # noqa: ANN001, F811
    body = (
        "def exact(response, ground_truth):\n    return float(response == ground_truth)\n"
        "def never(completions, **kwargs):\n    return [None] * len(completions)\n"
    )
    toml = (
        '[[reward.functions]]\nname = "exact"\nfunction = "reward.py:exact"\n'
        '[[reward.functions]]\nname = "never"\nfunction = "reward.py:never"\n'
    )
    proc = geartrain("check", str(_job(tmp_path, body, toml)), "--no-plugins")
    assert proc.returncode == 0, proc.stderr
    assert (
        "note: reward.functions[1].function: 'never' returned None for every probed row (4): a function that "
        "always does scores nothing" in proc.stdout
    ), proc.stdout


def leaves(response: str, ground_truth: str) -> float:
    if response == "5":
        raise SystemExit(4)
    return 1.0


def test_a_function_calling_sys_exit_fails_its_sample_at_once_and_the_job_goes_on(caplog: Any) -> None:
    """Probe rerun for item 8: a reward function calling ``sys.exit(4)`` made ``geartrain
    check`` wait the whole ``reward.timeout_s`` (300 s; the probe was stopped at 120 s): the
    exit ended the scoring thread silently, read as a timeout; with no timeout it would end
    the job. It is a failure of that sample, said as such, and the other samples score."""
    for timeout_s in (None, 300.0):
        scorer = RewardScorer([make_term(leaves, name="leaves")], timeout_s=timeout_s)
        with caplog.at_level(logging.WARNING, logger="geartrain.rewards"):
            result = scorer.score(["4", "5", "4"], ["4", "4", "4"])
        assert result.scores.tolist() == [1.0, 0.0, 1.0] and result.errors == [1], timeout_s
        assert result.metrics["reward/timeouts"] == 0.0
        assert "RewardExit: the reward function called sys.exit(4)" in caplog.text
        caplog.clear()


def test_check_names_a_function_calling_sys_exit_at_once(geartrain, tmp_path: Path) -> None:  # noqa: ANN001, F811
    """The same probe through ``geartrain check``: one line naming the function and the exit,
    exit 2, instead of a wait of ``reward.timeout_s``."""
    body = "import sys\ndef leaves(response, ground_truth):\n    sys.exit(4)\n"
    proc = geartrain(
        "check", str(_job(tmp_path, body, '[reward]\nfunction = "reward.py:leaves"\ntimeout_s = 30\n')), "--no-plugins"
    )
    assert proc.returncode == 2, proc.stderr
    assert "'reward.py:leaves' raised RewardExit: the reward function called sys.exit(4)" in proc.stderr, proc.stderr


def cancelled(response: str, ground_truth: str) -> float:
    import asyncio

    if response == "5":
        raise asyncio.CancelledError("the judge's loop was closed")
    return float(response == ground_truth)


def test_a_function_raising_another_base_exception_fails_its_sample_and_the_job_goes_on(caplog: Any) -> None:
    """Probe rerun for issue 35 item 8 (probes3): a reward function raising asyncio's
    CancelledError (a BaseException, from its own event loop) ended geartrain check with a
    traceback, exit 1. It is a failure of that sample, said as such, and the others score."""
    for timeout_s in (None, 300.0):
        scorer = RewardScorer([make_term(cancelled, name="cancelled")], timeout_s=timeout_s)
        with caplog.at_level(logging.WARNING, logger="geartrain.rewards"):
            result = scorer.score(["4", "5", "4"], ["4", "4", "4"])
        assert result.scores.tolist() == [1.0, 0.0, 1.0] and result.errors == [1], timeout_s
        assert "RewardExit: the reward function raised CancelledError: the judge's loop was closed" in caplog.text
        caplog.clear()


def test_check_names_a_function_raising_another_base_exception(geartrain, tmp_path: Path) -> None:  # noqa: ANN001, F811
    body = "import asyncio\ndef judge(response, ground_truth):\n    raise asyncio.CancelledError('closed')\n"
    proc = geartrain("check", str(_job(tmp_path, body, '[reward]\nfunction = "reward.py:judge"\n')), "--no-plugins")
    assert proc.returncode == 2, proc.stderr
    assert "'reward.py:judge' raised RewardExit: the reward function raised CancelledError: closed" in proc.stderr
    assert "Traceback" not in proc.stderr


def interrupts(response: str, ground_truth: str) -> float:
    if response == "5":
        raise KeyboardInterrupt  # the function's own raise (a library's Ctrl-C handling), not a Ctrl-C
    return float(response == ground_truth)


def test_a_function_raising_keyboard_interrupt_on_the_scoring_thread_fails_its_sample(caplog: Any) -> None:
    """Issue 35 round 10 (lead's probe): a reward raising KeyboardInterrupt itself, scored on
    the reward.timeout_s thread, killed that thread ("Exception in thread ..." and a
    traceback) and the batch waited the whole timeout, its samples then counted as timeouts.
    Off the main thread a KeyboardInterrupt is never Ctrl-C: a failure of its sample."""
    scorer = RewardScorer([make_term(interrupts, name="interrupts")], timeout_s=300.0)
    with caplog.at_level(logging.WARNING, logger="geartrain.rewards"):
        result = scorer.score(["4", "5", "4"], ["4", "4", "4"])
    assert result.scores.tolist() == [1.0, 0.0, 1.0] and result.errors == [1]
    assert result.metrics["reward/timeouts"] == 0.0
    assert "RewardExit: the reward function raised KeyboardInterrupt" in caplog.text
    # on the main thread (no timeout) it may be a real Ctrl-C, which stays one
    with pytest.raises(KeyboardInterrupt):
        RewardScorer([make_term(interrupts, name="interrupts")]).score(["5"], ["4"])


def test_a_scoring_thread_that_dies_is_raised_to_the_waiter_not_waited_out() -> None:
    """Whatever escapes the calls on the reward.timeout_s thread reaches the caller at once."""
    from geartrain.rewards.scoring import run_within

    def call(i: int) -> int:
        if i == 1:
            raise GeneratorExit("escaped")
        return i

    with pytest.raises(GeneratorExit, match="escaped"):
        run_within(3, call, 300.0, "dies")


def test_check_names_a_function_raising_keyboard_interrupt_at_once(geartrain, tmp_path: Path) -> None:  # noqa: ANN001, F811
    body = "def judge(response, ground_truth):\n    raise KeyboardInterrupt\n"
    job = _job(tmp_path, body, '[reward]\nfunction = "reward.py:judge"\ntimeout_s = 300\n')
    proc = geartrain("check", str(job), "--no-plugins")
    assert proc.returncode == 2, proc.stderr
    assert "'reward.py:judge' raised RewardExit: the reward function raised KeyboardInterrupt" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_decimal_score_is_a_number() -> None:
    """Probe rerun for issue 35 item 8 (probes3): a reward returning ``Decimal("0.5")`` was
    refused as 'not a number' while ``Fraction(1, 3)`` was taken (numbers.Real leaves Decimal
    out). A finite Decimal scores; a non-finite one (NaN, sNaN, Infinity) is refused."""
    from decimal import Decimal
    from fractions import Fraction

    from geartrain.rewards.scoring import parse_output

    assert parse_output(Decimal("0.5")) == (0.5, {})
    assert parse_output({"score": Decimal("-2"), "len": Decimal("3")})[0] == -2.0
    assert parse_output(Fraction(1, 4)) == (0.25, {})
    for bad in ("NaN", "sNaN", "Infinity"):
        with pytest.raises(ValueError, match="not finite"):
            parse_output(Decimal(bad))


class _FloatRaises(float):
    def __float__(self) -> float:
        raise RuntimeError("no float")


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (10**400, "reward score int is not finite as a float (int too large to convert to float)"),
        ("fraction", "reward score Fraction is not finite as a float (integer division result too large for a float)"),
        (_FloatRaises(0.5), "reward score _FloatRaises has no float value (RuntimeError: no float)"),
        ("meta", "reward score Tensor has no float value (RuntimeError: Tensor.item() cannot be called on meta"),
    ],
    ids=["int-10**400", "fraction-10**400", "float-raises", "meta-tensor"],
)
def test_a_number_with_no_finite_float_is_refused_not_a_traceback(value: Any, says: str) -> None:
    """Probe rerun for issue 35 item 8 (probes5): a reward returning ``10**400``,
    ``Fraction(10**400, 3)``, a float subclass whose ``float()`` raises or a meta tensor ended
    ``geartrain check`` in a 26-29-line traceback (OverflowError, RuntimeError), exit 1."""
    from fractions import Fraction

    import torch
    from geartrain.rewards.scoring import parse_output

    value = {"fraction": Fraction(10**400, 3), "meta": torch.empty((), device="meta")}.get(value, value)
    with pytest.raises(ValueError) as info:
        parse_output(value)
    assert str(info.value).startswith(says)
    assert parse_output({"score": 1.0, "huge": 10**400, "odd": _FloatRaises(1.0)}) == (1.0, {})


def test_numpys_bool_is_a_number_as_pythons_is() -> None:
    """Probe rerun for issue 35 item 8 (probes5): ``np.bool_`` (what ``pred == gold`` gives on
    numpy values) was refused as 'bool, not a number' while Python's ``True`` scores 1.0."""
    import numpy as np
    from geartrain.rewards.scoring import parse_output

    assert parse_output(np.bool_(True)) == (1.0, {}) == parse_output(True)
    assert parse_output({"score": np.bool_(False)}) == (0.0, {})


def test_check_names_a_score_whose_repr_python_refuses(geartrain, tmp_path: Path) -> None:  # noqa: ANN001, F811
    """``10**5000``: even its repr raises (Python's 4300-digit limit); check said it in a
    32-line ValueError traceback, exit 1."""
    body = "def huge(response, ground_truth):\n    return 10**5000\n"
    proc = geartrain("check", str(_job(tmp_path, body, '[reward]\nfunction = "reward.py:huge"\n')), "--no-plugins")
    assert proc.returncode == 2, proc.stderr
    assert "'reward.py:huge' returned int <int whose repr() raised ValueError> on " in proc.stderr, proc.stderr
    assert "reward score int is not finite as a float" in proc.stderr and "Traceback" not in proc.stderr
