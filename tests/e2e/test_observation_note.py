"""Issue 35, item 3, rerun in a whole job: an environment whose every observation is huge
(here ``reset``, a megabyte of multi-byte characters) is cut before tokenizing and said
once per run, as its message promises ("more like it are counted ..., not logged"); it
was said again at every step and every validation."""

from __future__ import annotations

import json
from pathlib import Path

from e2e_helpers import ROOT, run_geartrain

GUESS = ROOT / "examples" / "guess_number" / "grpo.toml"

FLOOD = """
from geartrain.agents import Environment, StepResult


class Flood(Environment):
    def reset(self, task):
        return "\\U0001F600\\u00e9" * 500_000

    def step(self, action):
        return StepResult(observation="+")
"""


def test_a_cut_observation_is_said_once_per_run_and_counted_every_step(tmp_path: Path) -> None:
    (tmp_path / "flood.py").write_text(FLOOD)
    out = tmp_path / "run"
    done = run_geartrain(
        "train",
        str(GUESS),
        "trainer.total_steps=3",
        "sft.enabled=false",
        "data.batch_size=2",
        "sampling.n=2",
        "validation.every_n_steps=1",
        "validation.max_prompts=2",
        "trainer.progress=false",
        "trainer.export_hf=false",
        f"rollout.agent.environment={tmp_path / 'flood.py'}:Flood",
        f"trainer.output_dir={out}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "before tokenizing" in line]
    assert len(said) == 1 and "an observation of 1000000 characters was cut to" in said[0], said
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    cut = [
        r["agent/observation_truncated"] for r in records if r.get("step", 0) > 0 and "agent/observation_truncated" in r
    ]
    assert cut == [4.0, 4.0, 4.0], cut  # every episode of every step: counted, not said
