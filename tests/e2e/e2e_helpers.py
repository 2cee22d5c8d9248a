"""Helpers for the end-to-end tests: run ``geartrain`` as a user would, in a subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAIN_CONFIG = ROOT / "examples" / "arithmetic" / "grpo.toml"

#: A small, fast variant of the main job for the tests that exercise the machinery
#: (resume, failures) rather than the learning: a short SFT and a dozen GRPO steps.
QUICK = [
    "sft.steps=20",
    "trainer.total_steps=8",
    "trainer.save_every=2",
    "validation.every_n_steps=4",
    "validation.max_prompts=32",
    "trainer.tensorboard=false",
    "trainer.export_hf=false",
]


def geartrain_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "geartrain.cli", *args]


#: a hang guard only, for a job or a check run by a test (or its start-up, or its exit after a
#: signal): the e2e jobs take minutes even on a loaded 2-core machine, so this never decides a
#: test; the order of events does
JOB_HANG_GUARD_S = 3600.0


def run_geartrain(*args: str, timeout: float = JOB_HANG_GUARD_S, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(geartrain_cmd(*args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def rl_records(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("phase") == "rl"]


def printed_accuracies(stdout: str, algo: str = "GRPO") -> tuple[float, float]:
    before = re.search(rf"accuracy before {algo}: ([\d.]+)%", stdout)
    after = re.search(rf"accuracy after {algo}: ([\d.]+)%", stdout)
    assert before and after, stdout[-2000:]
    return float(before.group(1)), float(after.group(1))
