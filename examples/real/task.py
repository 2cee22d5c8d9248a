"""The real-model task: small arithmetic questions in English, answered by
SmolLM2-135M-Instruct under its own chat template ("What is 7 times 8?" -> "... 56").

Five kinds of question (sums, differences, products, and two word problems) with small
numbers, each a different sentence. A fixed, seed-independent shuffle puts
``VALIDATION_SIZE`` distinct questions in the held-out set, never seen in training; the rest
are the RL prompts. The reward reads the response's *final answer*: the last integer it
states (as GSM8K-style graders do), so a reply that rambles past its answer, or is cut off
by the token budget mid-sentence, is scored by whatever number it ended on.

    python examples/real/task.py      # (re)writes examples/real/data/*.jsonl
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
VALIDATION_SIZE = 256
SPLIT_SEED = 1234
#: asked after every question: the base model often answers at length and runs out of tokens
INSTRUCTION = "Reply with just the number."

NAMES = ["Sam", "Ana", "Lee", "Mia", "Tom", "Ivy", "Max", "Zoe"]
THINGS = ["apples", "books", "coins", "cards", "pens", "stamps", "shells", "marbles"]


def questions() -> list[tuple[str, int]]:
    """Every question of the task with its answer, in a fixed order."""
    out: list[tuple[str, int]] = []
    for a in range(2, 41):
        for b in range(2, 41):
            out.append((f"What is {a} + {b}?", a + b))
            if a > b:
                out.append((f"What is {a} - {b}?", a - b))
    for a in range(2, 13):
        for b in range(2, 13):
            out.append((f"What is {a} times {b}?", a * b))
    for i, (name, thing) in enumerate((n, t) for n in NAMES for t in THINGS):
        for a in range(3, 25, 3):
            b = 2 + (a + i) % 9
            out.append((f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", a + b))
            if a > b:
                out.append((f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?", a - b))
    return out


def problems() -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """``(train, validation)``: disjoint, the same on every machine."""
    items = questions()
    random.Random(SPLIT_SEED).shuffle(items)
    return items[VALIDATION_SIZE:], items[:VALIDATION_SIZE]


def row(question: str, answer: int) -> dict[str, str]:
    return {"prompt": f"{question} {INSTRUCTION}", "ground_truth": str(answer)}


def write(data_dir: Path = DATA_DIR) -> dict[str, Path]:
    """Write ``train.jsonl`` (RL prompts) and ``val.jsonl`` (held out)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    train, val = problems()
    paths = {}
    for name, items in (("train", train), ("val", val)):
        path = data_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row(q, a)) + "\n" for q, a in items))
        paths[name] = path
    return paths


_INTEGER = re.compile(r"-?\d+")


def final_answer(response: str) -> int | None:
    """The last integer the response states (thousands separators ignored), or ``None``."""
    found = _INTEGER.findall(response.replace(",", ""))
    return int(found[-1]) if found else None


def final_answer_match(response: str, ground_truth: str) -> dict[str, float]:
    """1 when the response's final answer is the right number, else 0 (``acc`` the same:
    the held-out accuracy is the share of questions answered right)."""
    correct = final_answer(response) == int(ground_truth)
    return {"score": float(correct), "acc": float(correct)}


if __name__ == "__main__":
    for name, path in write().items():
        print(f"{name}: {path} ({sum(1 for _ in path.open())} rows)")
