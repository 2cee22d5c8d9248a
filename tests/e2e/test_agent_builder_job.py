"""An agent builder's run directory and console (issue 34, items 11 and 12), through
``geartrain train``: an environment that fails every step prints one line per step on the
console; ``episodes.log`` is headed by training steps and removed by ``--overwrite``;
``completions.jsonl`` says how each episode ended."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from e2e_helpers import run_geartrain

pytestmark = [pytest.mark.e2e]

FLAKY = '''
from geartrain.agents import Environment, StepResult


class Flaky(Environment):
    """Its first model turn gets an observation; the second raises in the episodes of the
    tasks with an even first digit (half of them: a run where every episode fails trained
    nothing, which is an error of its own)."""

    def reset(self, task):
        self.turns = 0
        self.fails = int(task["prompt"][0]) % 2 == 0
        return None

    def step(self, action):
        self.turns += 1
        if self.turns == 2 and self.fails:
            raise ValueError("the sandbox is gone")
        return StepResult(observation=" ok ")
'''

JOB = """
[model]
tiny = "qwen2"

[rollout]
backend = "torch"
max_model_len = 64

[rollout.agent]
environment = "flaky_env.py:Flaky"
max_turns = 3
max_tokens_per_turn = 4

[sampling]
n = 2
max_tokens = 4

[reward]
function = "arithmetic"

[data]
path = "rows.jsonl"
batch_size = 4
apply_chat_template = false

[validation]
path = "rows.jsonl"
every_n_steps = 1

[trainer]
total_steps = 2
save_every = 0
torch_threads = 1
log_completions = 8
export_hf = false
tensorboard = false
plot = false
progress = false
"""


def test_a_failing_environment_is_on_the_console_and_the_run_directory_says_how_episodes_ended(
    tmp_path: Path,
) -> None:
    (tmp_path / "flaky_env.py").write_text(FLAKY)
    (tmp_path / "rows.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "ground_truth": "1"}) + "\n" for i in range(4))
    )
    (tmp_path / "job.toml").write_text(JOB)
    out = tmp_path / "out"
    proc = run_geartrain("train", str(tmp_path / "job.toml"), f"trainer.output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # one line per generation (validation at 0, 1, 2 and the two training steps), naming the kind
    lines = [x for x in proc.stderr.splitlines() if "environment error in" in x]
    assert len(lines) == 5, proc.stderr[-3000:]
    assert all(
        re.search(
            r"environment error in \d+ of (4|8) episodes \(ValueError; agent/env_errors\): "
            r"ValueError: the sandbox is gone",
            x,
        )
        for x in lines
    ), lines
    assert len([x for x in lines if " of 8 episodes" in x]) == 2  # the training steps: 4 prompts x n=2

    log = (out / "episodes.log").read_text()
    assert re.findall(r"^--- step (\d+): validation episode\(s\) ---$", log, re.M) == ["0", "1", "2"]
    completions = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert completions and all(r["finish"] in {"done", "max_turns", "truncated", "error"} for r in completions)
    failed = [r for r in completions if r["finish"] == "error"]
    assert failed and all(r["error"] == "ValueError: the sandbox is gone" for r in failed)
    assert len(failed) < len(completions)  # the odd tasks' episodes ended otherwise
    assert all("error" not in r for r in completions if r["finish"] != "error")

    # --overwrite starts episodes.log afresh, with the other files of the run
    proc = run_geartrain(
        "train",
        str(tmp_path / "job.toml"),
        f"trainer.output_dir={out}",
        "trainer.total_steps=1",
        "--overwrite",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (out / "episodes.log").read_text()
    assert re.findall(r"^--- step (\d+): validation episode\(s\) ---$", log, re.M) == ["0", "1"]
