"""The arithmetic task: two-digit addition, ``"37+45="`` -> ``"82"``.

Every pair ``a + b`` with ``10 <= a, b <= 99`` is one problem (8100 in all). A fixed,
seed-independent shuffle puts 256 of them in the validation set, never seen in training;
the rest are training problems: the SFT rows and the RL prompts. The first ``DEV_SIZE`` of
them also form the SFT dev set, on which the warm start is scored while it trains (it
stops once partly right); they are training data, never validation data.

    python examples/arithmetic/task.py      # (re)writes examples/arithmetic/data/*.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
VALIDATION_SIZE = 256
DEV_SIZE = 256
SPLIT_SEED = 1234


def problems() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(train, validation)`` pairs; disjoint, the same on every machine."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    return pairs[VALIDATION_SIZE:], pairs[:VALIDATION_SIZE]


def row(a: int, b: int) -> dict[str, str]:
    return {"prompt": f"{a}+{b}=", "ground_truth": str(a + b), "response": str(a + b)}


def write(data_dir: Path = DATA_DIR) -> dict[str, Path]:
    """Write ``train.jsonl`` (SFT rows and RL prompts), ``sft_dev.jsonl`` and ``val.jsonl``."""
    data_dir.mkdir(parents=True, exist_ok=True)
    train, val = problems()
    paths = {}
    for name, pairs in (("train", train), ("sft_dev", train[:DEV_SIZE]), ("val", val)):
        path = data_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row(a, b)) + "\n" for a, b in pairs))
        paths[name] = path
    return paths


def exact_match(response: str, ground_truth: str) -> dict[str, float]:
    """1 when the response is exactly the sum (EOS already stripped), else 0."""
    correct = response.strip() == ground_truth.strip()
    return {"score": float(correct), "acc": float(correct)}


if __name__ == "__main__":
    for name, path in write().items():
        print(f"{name}: {path} ({sum(1 for _ in path.open())} rows)")
