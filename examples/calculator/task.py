"""The calculator task: 3-digit x 2-digit multiplication, ``"123*45="`` -> ``"5535"``, which
the tiny model cannot learn to compute in a few minutes but can learn to delegate.

A fixed, seed-independent shuffle of all pairs ``100 <= a <= 999``, ``10 <= b <= 99`` puts
256 in the validation set (never trained on), 256 in the SFT dev split, ``TRACES`` in the SFT
tool-use traces; the rest are RL prompts.

    python examples/calculator/task.py     # (re)writes examples/calculator/data/*.jsonl

A trace is one correct episode, turn by turn::

    {"prompt": "123*45=", "ground_truth": "5535",
     "turns": [{"role": "model", "text": "[calc 123*45]"},
               {"role": "observation", "text": "(5535)"},
               {"role": "model", "text": "5535"}]}
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data"
VALIDATION_SIZE = 256
DEV_SIZE = 256
TRACES = 400
TASK_TRACES = 40
RL_PROMPTS = 4000
SPLIT_SEED = 4321


def problems() -> dict[str, list[tuple[int, int]]]:
    pairs = [(a, b) for a in range(100, 1000) for b in range(10, 100)]
    rng = random.Random(SPLIT_SEED)
    picked = rng.sample(pairs, VALIDATION_SIZE + DEV_SIZE + TASK_TRACES + RL_PROMPTS)
    v, d, t = VALIDATION_SIZE, VALIDATION_SIZE + DEV_SIZE, VALIDATION_SIZE + DEV_SIZE + TASK_TRACES
    # The traces teach the format mostly on 2-digit x 2-digit problems: copying the task's
    # 3-digit operand into the call is left mostly for RL to get right.
    small = rng.sample([(a, b) for a in range(10, 100) for b in range(10, 100)], TRACES - TASK_TRACES)
    traces = small + picked[d:t]
    rng.shuffle(traces)
    return {"val": picked[:v], "sft_dev": picked[v:d], "traces": traces, "train": picked[t:]}


def row(a: int, b: int) -> dict[str, Any]:
    return {"prompt": f"{a}*{b}=", "ground_truth": str(a * b)}


def trace(a: int, b: int) -> dict[str, Any]:
    answer = str(a * b)
    return {
        **row(a, b),
        "turns": [
            {"role": "model", "text": f"[calc {a}*{b}]"},
            {"role": "observation", "text": f"({answer})"},
            {"role": "model", "text": answer},
        ],
    }


def write(data_dir: Path = DATA_DIR) -> dict[str, Path]:
    data_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, pairs in problems().items():
        make = trace if name == "traces" else row
        path = data_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(make(a, b)) + "\n" for a, b in pairs))
        paths[name] = path
    return paths


def exact_match(response: str, ground_truth: str, *, meta: dict[str, Any]) -> dict[str, float]:
    """1 when the episode's last model turn is exactly the product, else 0; the episode's
    tool use rides along as extras (``reward/used_tool``...)."""
    correct = response.strip() == ground_truth.strip()
    episode = meta.get("episode", {})
    calls = int(episode.get("tool_calls", 0))
    return {"score": float(correct), "acc": float(correct), "used_tool": float(calls > 0)}


if __name__ == "__main__":
    for name, path in write().items():
        print(f"{name}: {path} ({sum(1 for _ in path.open())} rows)")
