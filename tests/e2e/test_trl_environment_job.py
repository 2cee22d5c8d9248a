"""A TRL ``environment_factory`` class as a job's environment, through ``geartrain train``:
the class file is used as TRL users write it (reset(**row), a tool method, get_reward), the
prompt carries reset's text in its user turn, and the environment's score reaches every
episode's reward, the metrics and validation's accuracy. The score depends only on the row
(the parity of its answer), so its value is known whatever the random model does."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from e2e_helpers import run_geartrain

PARITY = '''
class Parity:
    def reset(self, **kwargs):
        self.answer = int(kwargs["answer"])
        return " Use the tool."

    def look(self) -> str:
        """Look at the number."""
        return str(self.answer)

    def get_reward(self) -> float:
        return 1.0 if self.answer % 2 == 0 else 0.0
'''

JOB = """
[model]
tiny = "qwen2"

[rollout]
backend = "torch"
max_model_len = 256

[rollout.agent]
environment = "parity_env.py:Parity"
chat_template = true
max_turns = 2
max_tokens_per_turn = 8

[sampling]
n = 4
max_tokens = 8

[reward]
function = "environment"

[data]
path = "rows.jsonl"
answer_key = "answer"
batch_size = 8

[validation]
path = "rows.jsonl"
every_n_steps = 2

[trainer]
total_steps = 2
save_every = 0
torch_threads = 1
log_completions = 64
export_hf = false
tensorboard = false
"""


def _train(tmp_path: Path, job: str, rows: list[dict[str, object]]) -> tuple[list[dict], list[dict]]:
    """``geartrain train`` on ``job`` over ``rows`` (next to the job file): the train
    records of completions.jsonl and the metrics lines."""
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "job.toml").write_text(job)
    out = tmp_path / "out"
    result = run_geartrain("train", str(tmp_path / "job.toml"), f"trainer.output_dir={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"], metrics


def _rows(environment: Callable[[int], str] | None = None) -> list[dict[str, object]]:
    """Rows ``n<i>?`` with answer ``i`` for i in 0..12; ``environment(i)`` names row i's."""
    rows: list[dict[str, object]] = [
        {"prompt": [{"role": "user", "content": f"n{i}?"}], "answer": i} for i in range(13)
    ]
    if environment is not None:
        for i, row in enumerate(rows):
            row["environment"] = environment(i)
    return rows


def test_a_trl_environment_class_scores_the_episodes_of_a_job(tmp_path: Path) -> None:
    (tmp_path / "parity_env.py").write_text(PARITY)
    train, metrics = _train(tmp_path, JOB, _rows())
    assert len(train) == 2 * 8 * 4
    for r in train:
        even = int(r["ground_truth"]) % 2 == 0
        assert r["env_rewards"][-1] == (1.0 if even else 0.0) and sum(r["env_rewards"]) == r["env_rewards"][-1], r
        assert r["reward"] == 0.0  # the "environment" reward adds nothing to get_reward's score
        # reset's text joined the user turn of the prompt (the char tokenizer's template)
        assert r["prompt"].endswith(f"user: n{r['ground_truth']}? Use the tool.\nassistant: "), r["prompt"]
    steps = [m for m in metrics if "agent/env_reward_mean" in m]
    assert len(steps) == 2
    for step in steps:
        assert step["reward/env_reward"] == step["agent/env_reward_mean"] == step["reward/accuracy"]
    validation = [m["val/accuracy"] for m in metrics if "val/accuracy" in m]
    assert validation and all(v == pytest.approx(7 / 13, abs=1e-6) for v in validation)  # 0, 2, ..., 12 of 0..12


THIRDS = '''
class Thirds:
    def __init__(self, score):
        self.score = score

    def reset(self, **kwargs):
        if "environment" in kwargs:
            raise ValueError("the control column reached reset")
        self.answer = int(kwargs["answer"])
        return " Count in threes."

    def peek(self) -> str:
        """Peek at the number."""
        return str(self.answer)

    def get_reward(self) -> float:
        return self.score if self.answer % 3 == 0 else 0.0
'''


def test_named_environments_each_score_the_rows_that_name_them(tmp_path: Path) -> None:
    """TRL's dict ``environment_factory`` as a table: each row's ``environment`` column
    picks its environment (with its own ``environment_kwargs``), on the trainer's ranks
    as in the data checks."""
    (tmp_path / "parity_env.py").write_text(PARITY + THIRDS)
    job = JOB.replace(
        'environment = "parity_env.py:Parity"',
        'environment = { parity = "parity_env.py:Parity", thirds = "parity_env.py:Thirds" }\n'
        "environment_kwargs = { thirds = { score = 0.5 } }",
    ).replace("total_steps = 2", "total_steps = 1")
    train, metrics = _train(tmp_path, job, _rows(lambda i: "thirds" if i >= 6 else "parity"))
    assert len(train) == 8 * 4
    for r in train:
        i = int(r["ground_truth"])
        expected = (0.5 if i % 3 == 0 else 0.0) if i >= 6 else (1.0 if i % 2 == 0 else 0.0)
        assert r["env_rewards"][-1] == expected, r
        told = " Count in threes." if i >= 6 else " Use the tool."
        assert r["prompt"].endswith(f"user: n{i}?{told}\nassistant: "), r["prompt"]
    validation = [m["val/accuracy"] for m in metrics if "val/accuracy" in m]
    # rewarded rows: 0, 2, 4 (parity) and 6, 9, 12 (thirds)
    assert validation and all(v == pytest.approx(6 / 13, abs=1e-6) for v in validation)


FLAGGED = '''
class Flagged:
    def __init__(self):
        self.client = object()  # what TRL environments hold beside data (a connection)

    def reset(self, **kwargs):
        self.answer = int(kwargs["answer"])
        self.reward = 1.0 if self.answer % 2 == 0 else 0.0
        return " Use the tool."

    def look(self) -> str:
        """Look at the number."""
        return str(self.answer)
'''

FROM_ENVIRONMENTS = """
def from_environments(environments, **kwargs):
    return [env.reward for env in environments]
"""


def test_a_trl_reward_function_reads_the_environments_of_a_job(tmp_path: Path) -> None:
    """TRL's reward functions read ``environments`` (``[env.reward for env in
    environments]``, TRL's OpenEnv examples): each sample's environment as its episode
    left it reaches the trainer's reward function, across the rank boundary."""
    (tmp_path / "parity_env.py").write_text(FLAGGED)
    (tmp_path / "env_rewards.py").write_text(FROM_ENVIRONMENTS)
    job = (
        JOB.replace("parity_env.py:Parity", "parity_env.py:Flagged")
        .replace('function = "environment"', 'function = "env_rewards.py:from_environments"')
        .replace("total_steps = 2", "total_steps = 1")
    )
    train, _ = _train(tmp_path, job, _rows())
    assert len(train) == 8 * 4
    for r in train:
        assert r["reward"] == (1.0 if int(r["ground_truth"]) % 2 == 0 else 0.0), r
