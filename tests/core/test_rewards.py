"""Reward functions, user-function resolution, the failure-tolerant batch scorer and the
reward-model hook."""

from __future__ import annotations

import logging
import math
import sys
import textwrap

import pytest
import torch
from geartrain import GeartrainError
from geartrain.rewards import (
    REWARDS,
    get_reward,
    last_boxed,
    normalize_math,
    register_reward,
    score_batch,
    sequence_scores_from_values,
    token_level_scores,
)


def score(name: str, response: str, truth: str, **meta) -> float:
    out = get_reward(name)(response, truth, prompt="", meta=meta)
    return out["score"] if isinstance(out, dict) else out


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("19", "19", 1.0),
        (" 19</s>", "19", 1.0),
        ("19 because 12+7", "19", 1.0),
        ("-4", "-4", 1.0),
        ("190", "19", 0.0),
        ("1", "19", 0.0),
        ("the answer is 19", "19", 0.0),  # the integer must come right after the prompt
        ("", "19", 0.0),
    ],
)
def test_arithmetic_exact_match(response, truth, expected):
    assert score("arithmetic", response, truth) == expected


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("She pays 3 * 6 = 18 dollars.\n#### 18", "18", 1.0),
        ("#### 1,000", "Janet ... so 1000 in total.\n#### 1000", 1.0),
        ("#### 18.0", "18", 1.0),
        ("#### 12\nwait\n#### 18", "18", 1.0),  # the last answer line counts
        ("#### -3", "-3", 1.0),
        ("#### 17", "18", 0.0),
        ("the answer is 18", "18", 0.0),
    ],
)
def test_gsm8k(response, truth, expected):
    assert score("gsm8k", response, truth) == expected


def test_gsm8k_format_score_from_meta():
    assert score("gsm8k", "#### 17", "18", format_score=0.1) == 0.1
    assert score("gsm8k", "17", "18", format_score=0.1) == 0.0


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        (r"so the answer is $\boxed{\frac{1}{2}}$.", "1/2", 1.0),
        (r"\boxed{0.5}", r"\dfrac{1}{2}", 1.0),
        (r"\boxed{ 42 }", r"The answer is \boxed{42}", 1.0),
        (r"\boxed{x = 5}", "5", 1.0),
        (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
        (r"\boxed{90^\circ}", "90", 1.0),
        (r"\boxed{\text{east}}", "east", 1.0),
        (r"\boxed{1}\ then \boxed{2}", "2", 1.0),
        (r"\boxed{\sqrt{2}}", r"\sqrt{2}", 1.0),
        (r"\boxed{3}", "2", 0.0),
        (r"\boxed{3", "3", 0.0),  # never closed
        ("3", "3", 0.0),  # no box
    ],
)
def test_math_boxed(response, truth, expected):
    assert score("math_boxed", response, truth) == expected


def test_boxed_helpers():
    assert last_boxed(r"a \boxed{\frac{a}{b}} b") == r"\frac{a}{b}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed("none") is None
    assert normalize_math(r"\tfrac{2}{4}") == "1/2"
    assert normalize_math("1,000") == "1000"


@pytest.mark.parametrize(
    ("name", "response", "expected"),
    [
        ("format_boxed", r"x \boxed{1}", 1.0),
        ("format_boxed", "x 1", 0.0),
        ("format_gsm8k", "#### 3", 1.0),
        ("format_gsm8k", "3", 0.0),
        ("format_think", "<think>a\nb</think> 42", 1.0),
        ("format_think", "<think>a</think>", 0.0),
        ("format_think", "42 <think>a</think> 1", 0.0),
    ],
)
def test_format_checks(name, response, expected):
    assert score(name, response, "") == expected


# ------------------------------------------------------------------ user functions
def test_user_callable_with_short_signature_and_registry():
    def my_len(response, ground_truth):
        return len(response) - len(ground_truth)

    assert score_batch(my_len, ["abcd", "ab"], ["a", "b"]).scores.tolist() == [3.0, 1.0]

    @register_reward("test_uses_prompt")
    def uses_prompt(response, ground_truth, *, prompt, meta):
        return {"score": float(prompt == meta["expected_prompt"]), "acc": 0.5}

    try:
        out = score_batch("test_uses_prompt", ["x"], ["y"], prompts=["p"], metas=[{"expected_prompt": "p"}])
        assert out.scores.tolist() == [1.0] and out.metrics["reward/acc"] == 0.5
    finally:
        REWARDS._entries.pop("test_uses_prompt")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    pkg = tmp_path / "my_rewards_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scorers.py").write_text(
        textwrap.dedent(
            """
            def contains(response, ground_truth, *, prompt, meta):
                return float(ground_truth in response)

            class Nested:
                @staticmethod
                def half(response, ground_truth, **kwargs):
                    return {"score": 0.5, "note": "not a number, ignored"}
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards_pkg.scorers"
    for name in [m for m in sys.modules if m.startswith("my_rewards_pkg")]:
        del sys.modules[name]


def test_user_function_by_dotted_path(user_module):
    for spec in (f"{user_module}:contains", f"{user_module}.contains"):
        assert score_batch(spec, ["the cat", "dog"], ["cat", "cat"]).scores.tolist() == [1.0, 0.0]
    out = score_batch(f"{user_module}:Nested.half", ["a"], ["b"])
    assert out.scores.tolist() == [0.5] and "reward/note" not in out.metrics
    with pytest.raises(GeartrainError, match="has no attribute 'nope'"):
        get_reward(f"{user_module}:nope")
    with pytest.raises(GeartrainError, match="cannot import module 'no_such_pkg_xyz.mod'"):
        get_reward("no_such_pkg_xyz.mod:fn")
    with pytest.raises(GeartrainError, match="unknown reward function 'nonsense'.*arithmetic"):
        get_reward("nonsense")


# ------------------------------------------------------------------ failures
def test_failing_and_non_finite_scores_give_zero_counted_and_logged_once(caplog):
    def flaky(response, ground_truth, *, prompt, meta):
        if response == "boom":
            raise RuntimeError("scorer bug")
        if response == "nan":
            return math.nan
        if response == "inf":
            return {"score": math.inf}
        if response == "text":
            return "1.0"
        if response == "nokey":
            return {"acc": 1.0}
        return {"score": 1.0, "acc": 1.0}

    responses = ["ok", "boom", "nan", "ok", "inf", "text", "boom", "nokey"]
    with caplog.at_level(logging.WARNING, logger="geartrain.rewards"):
        out = score_batch(flaky, responses, ["t"] * 8, prompts=[f"prompt {i}" for i in range(8)])
    assert out.scores.tolist() == [1.0, 0, 0, 1.0, 0, 0, 0, 0]
    assert out.errors == [1, 2, 4, 5, 6, 7]
    assert out.metrics["reward/errors"] == 6.0
    assert out.metrics["reward/mean"] == pytest.approx(2 / 8)
    assert out.metrics["reward/acc"] == 1.0  # over the samples that reported it
    assert out.extras["acc"] == [1.0, None, None, 1.0, None, None, None, None]
    records = [r for r in caplog.records if r.name == "geartrain.rewards"]
    assert len(records) == 2  # the first failure in full, then one summary line
    assert "scorer bug" in records[0].getMessage() and "'prompt 1'" in records[0].getMessage()
    assert records[0].exc_info is not None
    assert "6 of 8" in records[1].getMessage()


def test_score_batch_checks_lengths():
    with pytest.raises(ValueError, match="2 responses, 1 ground truths"):
        score_batch("arithmetic", ["1", "2"], ["1"])


# ------------------------------------------------------------------ tensors
def test_token_level_scores_on_last_response_token():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]])
    out = token_level_scores(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    assert out.tolist() == [[0, 0, 1, 0], [0, 0, 0, 2], [0, 0, 0, 0], [0, 0, 4, 0]]


def test_reward_model_sequence_score_is_last_response_value():
    values = torch.tensor([[0.1, 0.2, 0.3, 0.4], [1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [0, 0, 0, 0]])
    assert sequence_scores_from_values(values, mask).tolist() == pytest.approx([0.3, 4.0, 0.0])


def test_reward_model_hook_on_a_tiny_value_model():
    from geartrain import ModelConfig
    from geartrain.modeling import build_hf_model

    model = build_hf_model(ModelConfig(tiny="qwen2", value_head=True)).eval()
    input_ids = torch.tensor([[0, 5, 6, 7, 8, 2], [9, 10, 11, 12, 2, 0]])
    attention = (input_ids != 0).long()
    response_mask = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 0]])
    with torch.no_grad():
        head = model(input_ids=input_ids, attention_mask=attention).logits[..., 0]  # [B, T], output at t
    values = torch.cat([torch.zeros(2, 1), head[:, :-1]], dim=1)  # aligned: values[:, t] = V(x_<t)
    scores = sequence_scores_from_values(values, response_mask)
    # last response token of row 0 is column 5 -> the head's output at column 4; row 1: column 4 -> 3
    assert scores.tolist() == pytest.approx([head[0, 4].item(), head[1, 3].item()])


def test_resolving_an_adapted_reward_again_keeps_it_callable() -> None:
    from geartrain.rewards import get_reward

    def two_args(response: str, ground_truth: str) -> float:
        return float(response == ground_truth)

    once = get_reward(two_args)
    twice = get_reward(once)
    assert twice is once
    assert twice("7", "7", prompt="3+4=", meta={}) == 1.0
