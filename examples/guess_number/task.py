"""Guess the number (see env.py): data, format-only SFT traces, and the reward.

Every task is a secret digit ``1..9`` behind the prompt ``"guess:"``. The SFT traces play
*hint-blind*: each guess is drawn uniformly, whatever the hints said, so the warm start
learns the format (a digit, ``;``, read a hint, guess again) and nothing about using the
hints; it finds the secret within 4 turns about 38 % of the time. Halving the interval with
each hint finds every secret within 4 turns: what GRPO has to discover.

    python examples/guess_number/task.py     # (re)writes examples/guess_number/data/*.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data"
SECRETS = range(1, 10)
MAX_TURNS = 4
TRACES = 600
TRAIN_ROWS = 900
SEED = 99


def row(secret: int) -> dict[str, Any]:
    return {"prompt": "guess:", "ground_truth": str(secret)}


def hint_blind_trace(secret: int, rng: random.Random) -> dict[str, Any]:
    """One episode of uniform guessing: model turns ``"d;"``, observations ``+``/``-``."""
    turns: list[dict[str, str]] = []
    for _ in range(MAX_TURNS):
        guess = rng.choice(SECRETS)
        turns.append({"role": "model", "text": f"{guess};"})
        if guess == secret:
            break
        if len(turns) < 2 * MAX_TURNS - 1:
            turns.append({"role": "observation", "text": "+" if secret > guess else "-"})
    if turns[-1]["role"] == "observation":
        turns.pop()
    return {**row(secret), "turns": turns}


def write(data_dir: Path = DATA_DIR) -> dict[str, Path]:
    """``traces.jsonl`` (SFT), ``train.jsonl`` (RL tasks: every secret, shuffled) and
    ``val.jsonl`` (each secret once: greedy play is deterministic)."""
    rng = random.Random(SEED)
    data_dir.mkdir(parents=True, exist_ok=True)
    rows = {
        "traces": [hint_blind_trace(rng.choice(SECRETS), rng) for _ in range(TRACES)],
        "train": [row(s) for s in rng.choices(SECRETS, k=TRAIN_ROWS)],
        "val": [row(s) for s in SECRETS],
    }
    paths = {}
    for name, items in rows.items():
        path = data_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(item) + "\n" for item in items))
        paths[name] = path
    return paths


def solved(response: str, ground_truth: str, *, meta: dict[str, Any]) -> dict[str, float]:
    """1 when the episode found the secret (the environment's reward), else 0; the turns
    it took ride along as ``reward/turns``."""
    episode = meta.get("episode", {})
    found = float(sum(episode.get("rewards", [])) > 0)
    return {"score": found, "acc": found, "turns": float(episode.get("model_turns", 0))}


if __name__ == "__main__":
    for name, path in write().items():
        print(f"{name}: {path} ({sum(1 for _ in path.open())} rows)")
