"""The reward contract (issue 19, items 1-3): per-sample and TRL-style batched functions,
several weighted functions each logged on its own, ``geartrain check`` calling every
function on the first rows, and no silent model/reward defaults for a job's own data."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
from geartrain import GeartrainError
from geartrain.batch import Batch
from geartrain.cli import main
from geartrain.data import PromptDataset, PromptLoader
from geartrain.errors import ConfigError
from geartrain.rewards import RewardResult, RewardScorer, batched_reward, detect_batched, make_term
from geartrain.testing.tiny import tiny_tokenizer
from geartrain.trainer import load_train_config
from geartrain.trainer.config import TrainConfig
from geartrain.trainer.preflight import preflight
from geartrain.trainer.roles import RewardWorker
from geartrain.types import EngineContext


@pytest.fixture
def geartrain(capsys: pytest.CaptureFixture[str]):  # noqa: ANN201
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        rc = main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["geartrain", *args], rc, out.out, out.err)

    return run


# ------------------------------------------------------------------ batched and weighted
def trl_length(prompts, completions, **kwargs):  # noqa: ANN001, ANN003, ANN201
    return [float(len(c)) for c in completions]


def test_batched_reward_is_detected_and_called_once_with_columns() -> None:
    calls = []

    def exact(completions, ground_truth, level):  # noqa: ANN001, ANN202  (TRL names its first parameter)
        calls.append((list(completions), list(ground_truth), list(level)))
        return [float(c == t) for c, t in zip(completions, ground_truth, strict=True)]

    @batched_reward
    def marked(a, b, **columns):  # noqa: ANN001, ANN003, ANN202
        return [1.0] * len(b)

    assert detect_batched(exact) and detect_batched(trl_length) and detect_batched(marked)
    assert not detect_batched(lambda response, ground_truth: 0.0)
    out = RewardScorer(exact).score(
        ["4", "5", "6"], ["4", "4", "6"], prompts=["p"] * 3, metas=[{"level": 1}, {"level": 2}, {"level": 3}]
    )
    assert out.scores.tolist() == [1.0, 0.0, 1.0]
    assert calls == [(["4", "5", "6"], ["4", "4", "6"], [1, 2, 3])]  # one call for the batch, columns as lists


def test_several_weighted_functions_sum_and_are_logged_each() -> None:
    def exact(response, ground_truth):  # noqa: ANN001, ANN202
        return {"score": float(response == ground_truth), "acc": float(response == ground_truth)}

    terms = [make_term(exact, name="correct", weight=1.0), make_term(trl_length, name="length", weight=-0.1)]
    out = RewardScorer(terms).score(["42", "7", "123"], ["42", "42", "123"])
    assert out.scores.tolist() == pytest.approx([1 - 0.2, 0 - 0.1, 1 - 0.3])
    assert out.metrics["reward/correct/mean"] == pytest.approx(2 / 3)
    assert out.metrics["reward/length/mean"] == pytest.approx(2.0)
    assert out.metrics["reward/acc"] == pytest.approx(2 / 3)  # accuracy: from the term that reports it
    assert out.term_scores == {"correct": [1.0, 0.0, 1.0], "length": [2.0, 1.0, 3.0]}


def test_a_batched_function_returning_the_wrong_length_fails_the_batch_not_the_run() -> None:
    out = RewardScorer(lambda prompts, completions: [1.0]).score(["a", "b"], ["x", "y"])
    assert out.scores.tolist() == [0.0, 0.0] and out.errors == [0, 1]


def test_a_signature_that_fits_neither_convention_is_refused_by_name() -> None:
    def one_arg(text):  # noqa: ANN001, ANN202
        return 1.0

    with pytest.raises(GeartrainError, match="reward function 'one_arg': a per-sample reward is called as"):
        make_term(one_arg)
    with pytest.raises(GeartrainError, match="requires 'threshold'"):
        make_term(lambda response, ground_truth, threshold: 1.0)


# ------------------------------------------------------------------ TRL's None: a term that does not apply
def math_reward(completions: list[str], task: list[str], **kwargs: Any) -> list[float | None]:
    return [(1.0 if c == "4" else 0.0) if t == "math" else None for c, t in zip(completions, task, strict=True)]


def code_reward(completions: list[str], task: list[str], **kwargs: Any) -> list[float | None]:
    return [(0.5 if "def" in c else 0.0) if t == "code" else None for c, t in zip(completions, task, strict=True)]


def test_a_trl_multi_task_reward_returning_none_skips_that_term_for_that_sample() -> None:
    """TRL's GRPOTrainer turns ``None`` into NaN and sums ``nansum(weight x score)``; each
    term's mean is over the samples it scored (``nanmean``), not the batch."""
    scorer = RewardScorer([make_term(math_reward, weight=1.0), make_term(code_reward, weight=2.0)])
    result = scorer.score(
        ["4", "5", "def f(): pass"],
        ["4", "4", ""],
        prompts=["2+2=", "2+2=", "write f"],
        metas=[{"task": "math"}, {"task": "math"}, {"task": "code"}],
    )
    assert result.errors == []
    assert result.scores.tolist() == pytest.approx([1.0, 0.0, 1.0])
    assert result.term_scores == {"math_reward": [1.0, 0.0, None], "code_reward": [None, None, 0.5]}
    assert result.metrics["reward/math_reward/mean"] == pytest.approx(0.5)  # over 2 samples, not 3
    assert result.metrics["reward/code_reward/mean"] == pytest.approx(0.5)  # over 1 sample, not 3
    assert result.metrics["reward/error_fraction"] == 0.0


def test_a_sample_every_term_returns_none_for_is_a_counted_failure(caplog: pytest.LogCaptureFixture) -> None:
    scorer = RewardScorer([make_term(math_reward), make_term(code_reward)])
    with caplog.at_level("WARNING", logger="geartrain.rewards"):
        result = scorer.score(["4", "4"], ["4", "4"], metas=[{"task": "math"}, {"task": "poetry"}])
    assert result.scores.tolist() == [1.0, 0.0]
    assert result.errors == [1] and result.metrics["reward/errors"] == 1.0
    assert result.term_scores == {"math_reward": [1.0, None], "code_reward": [None, None]}
    assert "reward/code_reward/mean" not in result.metrics  # it scored no sample: no mean of 0
    assert "every reward function (2) returned None for this sample" in caplog.text
    # one term, per sample: None everywhere is the same failure
    alone = RewardScorer(lambda response, ground_truth: None).score(["a", "b"], ["a", "b"])
    assert alone.errors == [0, 1] and alone.scores.tolist() == [0.0, 0.0]


# ------------------------------------------------------------------ TRL's conversational shapes
def conversational_reward(completions: list[list[dict[str, str]]], **kwargs: Any) -> list[float]:
    """TRL's documented shape for conversational datasets (e.g. its format reward examples)."""
    return [float(len(c[0]["content"]) > 0) for c in completions]


def test_a_trl_conversational_reward_reads_completions_as_messages() -> None:
    """On conversational rows TRL calls a reward function with ``prompts`` = each row's
    messages and ``completions=[[{"role": "assistant", "content": text}], ...]``; geartrain
    check calls it so, and passes it."""
    config = TrainConfig.model_validate(
        {"model": {"tiny": "qwen2"}, "data": {"max_prompt_length": 64, "batch_size": 2}}
    )
    rows = [{"messages": [{"role": "user", "content": "2+2="}], "ground_truth": "4"}] * 2
    pre = preflight(config, reward_fn=conversational_reward, tokenizer=tiny_tokenizer(), data=rows)
    assert pre.reward is not None and pre.reward[0].batched


def test_a_batched_reward_gets_trls_shapes_per_row_through_the_reward_worker() -> None:
    """Rows from TRL's conversational format get message shapes, plain rows strings, through
    the path a run takes: the loader's per-sample metadata into the reward worker. A
    per-sample (geartrain) function keeps strings for both."""
    tok = tiny_tokenizer()
    question = [{"role": "user", "content": "2+2="}]
    rows = [{"prompt": question, "ground_truth": "4"}, {"prompt": "3+3=", "ground_truth": "6"}]
    prompts = PromptLoader(PromptDataset(rows, tok), 2, shuffle=False).next_batch()
    batch = Batch(meta={**prompts.sample_meta(2), "response_text": ["4", "5", "6", "7"]})
    seen: dict[str, Any] = {}

    def trl_exact(prompts, completions, ground_truth, **kwargs):  # noqa: ANN001, ANN003, ANN202
        seen.update(prompts=prompts, completions=completions)
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [float(t == g) for t, g in zip(texts, ground_truth, strict=True)]

    def per_sample(response, ground_truth, *, prompt, meta):  # noqa: ANN001, ANN202
        seen.setdefault("per_sample", []).append((response, prompt))
        return 0.0

    worker = RewardWorker([make_term(trl_exact), make_term(per_sample)], None, None, ctx=EngineContext(role="reward"))
    result = RewardResult.from_rows(worker.score(batch))
    assert result.errors == [] and result.scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert seen["prompts"] == [question, question, "3+3=", "3+3="]
    assert seen["completions"] == [
        [{"role": "assistant", "content": "4"}],
        [{"role": "assistant", "content": "5"}],
        "6",
        "7",
    ]
    chat = tok.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
    assert seen["per_sample"] == [("4", chat), ("5", chat), ("6", "3+3="), ("7", "3+3=")]


# ------------------------------------------------------------------ geartrain check calls them
def _job(tmp_path: Path, reward_py: str, reward_toml: str) -> Path:
    (tmp_path / "train.jsonl").write_text(
        "".join(f'{{"prompt": "{w}->", "ground_truth": "{w[::-1]}"}}\n' for w in ["abc", "hello", "word", "tiny"])
    )
    (tmp_path / "reward.py").write_text(textwrap.dedent(reward_py))
    job = tmp_path / "job.toml"
    job.write_text(
        '[model]\ntiny = "qwen2"\n'
        + reward_toml
        + '[data]\npath = "train.jsonl"\nbatch_size = 2\napply_chat_template = false\n'
        + f'[trainer]\noutput_dir = "{tmp_path / "out"}"\n'
    )
    return job


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            "def score(response, ground_truth):\n    return 1 / 0\n",
            "reward.function: 'reward.py:score' raised ZeroDivisionError: division by zero (on ",
        ),
        (
            "def score(response):\n    return 1.0\n",
            "reward.function: reward function 'reward.py:score': a per-sample reward is called as",
        ),
        (
            "def score(response, ground_truth):\n    return 'yes'\n",
            "reward.function: 'reward.py:score' returned str 'yes' on ",
        ),
        (
            "def score(prompts, completions, **kw):\n    return {'score': 1.0}\n",
            "reward.function: 'reward.py:score' raised TypeError: a batched reward must return a list of 4 scores",
        ),
    ],
    ids=["raises", "signature", "return-type", "batched-return"],
)
def test_check_calls_the_reward_and_reports_what_step_1_would(
    geartrain, tmp_path: Path, body: str, expected: str
) -> None:
    proc = geartrain("check", str(_job(tmp_path, body, '[reward]\nfunction = "reward.py:score"\n')), "--no-plugins")
    assert proc.returncode == 2, proc.stdout
    assert expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_check_passes_a_good_reward_and_reports_each_function(geartrain, tmp_path: Path) -> None:
    body = (
        "def exact(response, ground_truth):\n    return float(response == ground_truth)\n"
        "def short(prompts, completions):\n    return [-len(c) / 10 for c in completions]\n"
    )
    toml = (
        '[[reward.functions]]\nname = "exact"\nfunction = "reward.py:exact"\n'
        '[[reward.functions]]\nname = "short"\nfunction = "reward.py:short"\nweight = 0.5\n'
    )
    proc = geartrain("check", str(_job(tmp_path, body, toml)), "--no-plugins")
    assert proc.returncode == 0, proc.stderr
    assert "checked: reward 'exact', 'short' resolves and scores the first rows" in proc.stdout


def test_function_and_functions_exclude_each_other_and_names_are_unique() -> None:
    with pytest.raises(ConfigError, match="reward.function or \\[\\[reward.functions\\]\\], not both"):
        load_train_config(
            None, ["reward.function=gsm8k", 'reward.functions=[{name = "a", function = "gsm8k"}]'], check_plugins=False
        )
    with pytest.raises(ConfigError, match="two reward.functions are named 'a'"):
        load_train_config(
            None,
            ['reward.functions=[{name = "a", function = "gsm8k"}, {name = "a", function = "x"}]'],
            check_plugins=False,
        )


# ------------------------------------------------------------------ item 3: no silent defaults
def test_a_job_with_its_own_data_must_name_its_model_and_reward(geartrain, tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text('{"prompt": "abc->", "ground_truth": "cba"}\n' * 4)
    job = tmp_path / "job.toml"
    job.write_text('[data]\npath = "train.jsonl"\nbatch_size = 2\n')
    proc = geartrain("check", str(job))
    assert proc.returncode == 2
    assert 'model.path: not set: name the policy to train, model.path = "<hub id or directory>"' in proc.stderr
    job.write_text(
        '[model]\ntiny = "qwen2"\n[data]\npath = "train.jsonl"\nbatch_size = 2\napply_chat_template = false\n'
    )
    proc = geartrain("check", str(job), "--no-plugins")
    assert proc.returncode == 2
    assert "reward.function: not set: name how responses are scored" in proc.stderr
    assert "model.path" not in proc.stderr
    # a config without data of its own keeps the try-the-pipeline defaults
    assert load_train_config(None, [], check_plugins=False).model.tiny == "qwen2"


def test_a_trl_function_gets_the_answer_column_by_its_own_name(geartrain, tmp_path: Path) -> None:
    (tmp_path / "words.jsonl").write_text('{"prompt": "abc->", "answer": "cba", "level": 2}\n' * 4)
    (tmp_path / "reward.py").write_text(
        "def reversed_word(completions, answer, level, **kwargs):\n"
        "    assert level == [2] * len(completions)\n"
        "    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]\n"
    )
    job = tmp_path / "job.toml"
    job.write_text(
        '[model]\ntiny = "qwen2"\n[reward]\nfunction = "reward.py:reversed_word"\n'
        '[data]\npath = "words.jsonl"\nanswer_key = "answer"\nbatch_size = 2\napply_chat_template = false\n'
        f'[trainer]\noutput_dir = "{tmp_path / "out"}"\n'
    )
    proc = geartrain("check", str(job), "--no-plugins")
    assert proc.returncode == 0, proc.stderr
    from geartrain.trainer.preflight import preflight

    pre = preflight(load_train_config(job, check_plugins=False))
    assert pre.reward is not None
    out = RewardScorer(pre.reward).score(["cba", "abc"], ["cba", "cba"], metas=[{"level": 2}, {"level": 2}])
    assert out.scores.tolist() == [1.0, 0.0]


def test_a_reward_that_raises_on_some_rows_only_passes_check_with_a_note(geartrain, tmp_path: Path) -> None:
    # what a run tolerates (those samples score 0 and are counted) is not refused up front
    body = (
        "def score(response, ground_truth):\n"
        "    if ground_truth == 'olleh':\n"
        "        raise KeyError('no')\n"
        "    return 1.0\n"
    )
    proc = geartrain("check", str(_job(tmp_path, body, '[reward]\nfunction = "reward.py:score"\n')), "--no-plugins")
    assert proc.returncode == 0, proc.stderr
    assert (
        "raised KeyError: 'no'" in proc.stdout + proc.stderr
        and "1 of 4 probed rows raised" in proc.stdout + proc.stderr
    )


def test_check_notes_rows_no_function_scores_and_refuses_when_none_is_scored(geartrain, tmp_path: Path) -> None:
    body = (
        "def some(completions, ground_truth):\n"
        "    return [None if g == 'olleh' else 1.0 for g in ground_truth]\n"
        "def nothing(completions, **kwargs):\n"
        "    return [None] * len(completions)\n"
    )
    toml = '[[reward.functions]]\nname = "some"\nfunction = "reward.py:some"\n'
    proc = geartrain("check", str(_job(tmp_path, body, toml)), "--no-plugins")
    assert proc.returncode == 0, proc.stderr
    assert "every reward function returned None on 1 of 4 probed rows (first: " in proc.stdout + proc.stderr
    toml += '[[reward.functions]]\nname = "nothing"\nfunction = "reward.py:nothing"\n'
    proc = geartrain("check", str(_job(tmp_path, body, toml)), "--no-plugins")
    assert proc.returncode == 0, proc.stderr  # 'nothing' applies nowhere, 'some' scores 3 rows: a note
    proc = geartrain("check", str(_job(tmp_path, body, '[reward]\nfunction = "reward.py:nothing"\n')), "--no-plugins")
    assert proc.returncode == 2
    assert "reward.function: every reward function returned None on 4 of 4 probed rows" in proc.stderr


def test_a_reward_file_may_use_dataclasses_with_postponed_annotations(tmp_path: Path) -> None:
    """A user file is not an importable module: a @dataclass with string annotations (``from
    __future__ import annotations``) looks its module up while the class is made, and must
    find it; afterwards the function still travels by value (the module is not importable)."""
    import pickle
    import sys

    import cloudpickle
    from geartrain.trainer.preflight import resolve_reward

    (tmp_path / "scored.py").write_text(
        textwrap.dedent("""
        from __future__ import annotations
        from dataclasses import dataclass

        @dataclass
        class Weights:
            exact: float = 1.0
            partial: float = 0.5

        def reward(response: str, ground_truth: str) -> float:
            w = Weights()
            return w.exact if response.strip() == ground_truth else w.partial * (ground_truth in response)
    """)
    )
    fn = resolve_reward("scored.py:reward", str(tmp_path))
    assert fn("42", "42") == 1.0 and fn("x 42", "42") == 0.5 and fn("7", "42") == 0.0
    assert "geartrain_user_scored" not in sys.modules
    assert pickle.loads(cloudpickle.dumps(fn))("42", "42") == 1.0  # by value, as Ray sends it


def test_an_extra_of_numpys_bool_or_a_one_element_tensor_is_a_number() -> None:
    """Issue 35, round 14: ``{"score": ..., "acc": np.bool_(ok)}`` had its ``acc`` dropped
    (numpy's bool is no ``numbers.Real``): accuracy fell back to "score > 0" and a run whose
    every answer was wrong, with a 0.5 format credit, reported 100 %."""
    import numpy as np
    import torch
    from geartrain.rewards.scoring import parse_output

    _, extras = parse_output({"score": 0.5, "acc": np.bool_(False), "t": torch.tensor(1.0), "v": torch.ones(2)})
    assert extras == {"acc": 0.0, "t": 1.0}
    _, extras = parse_output({"score": 0.5, "acc": np.bool_(True), "n": np.int64(3), "d": np.float32(0.25)})
    assert extras == {"acc": 1.0, "n": 3.0, "d": 0.25}


def test_two_reward_files_importing_their_own_sibling_module_of_one_name_are_refused(tmp_path: Path) -> None:
    """Issue 35, round 15: ``a/ra.py`` and ``b/rb.py`` each ``import helpers`` of its own
    directory: the second got the first's module (one process holds one module per name) and
    scored with it, silently."""
    import sys

    from geartrain.user_code import load_from_file

    name = "gt_probe15_helpers"
    for sub, value in (("a", 1.0), ("b", -1.0)):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / f"{name}.py").write_text(f"def value():\n    return {value}\n")
        (tmp_path / sub / f"r{sub}.py").write_text(
            f"import {name}\n\ndef f(response, ground_truth):\n    return {name}.value()\n"
        )
    try:
        assert load_from_file("a/ra.py:f", str(tmp_path), what="reward function", key="k")("x", "y") == 1.0
        with pytest.raises(GeartrainError) as err:
            load_from_file("b/rb.py:f", str(tmp_path), what="reward function", key="k")
        assert f"imports '{name}', meant as its sibling {tmp_path / 'b' / (name + '.py')}" in str(err.value)
        assert str(tmp_path / "a" / f"{name}.py") in str(err.value)
    finally:
        sys.modules.pop(name, None)
        for sub in ("a", "b"):
            if str(tmp_path / sub) in sys.path:
                sys.path.remove(str(tmp_path / sub))


@pytest.mark.parametrize("acc", ["0", "yes", float("nan"), [1]])
def test_an_acc_that_is_no_number_is_an_error_not_dropped(acc: object) -> None:
    """Issue 35, round 15: ``{"score": 0.5, "acc": "0"}`` had its acc dropped: accuracy fell
    back to "score > 0" and an always-wrong run read 100 %; the warning said the function
    returned no acc. An acc that is no finite number is the output's error."""
    from geartrain.rewards.scoring import parse_output

    with pytest.raises(ValueError, match="reward 'acc' is .* not a number or bool"):
        parse_output({"score": 0.5, "acc": acc})
    assert parse_output({"score": 0.5, "acc": None}) == (0.5, {})  # None: the sample has no accuracy
