"""The real model as an agent: SmolLM2-135M-Instruct answers arithmetic it mostly gets wrong
alone (2-digit x 2-digit products, sums of two 3-digit numbers) with a calculator tool it
calls in the Hermes format under its own chat template.

SmolLM2's template is plain ChatML and ignores ``apply_chat_template(tools=...)``, so, as the
Hermes convention (and Qwen's template) does, the system turn lists the tool: its JSON spec
inside ``<tools></tools>`` and how to call it (:func:`system_prompt`; the job files carry this
text as ``data.system_prompt``, a test checks they agree). A call is
``<tool_call>{"name": "calc", "arguments": {"expression": "47 * 86"}}</tool_call>``; the
result comes back as a ``tool`` turn; a turn without a call is the final answer.

A fixed, seed-independent shuffle puts ``VALIDATION_SIZE`` questions in the held-out set,
``DEV_SIZE`` in the warm start's dev split and ``TRACES`` in its tool-use traces (one correct
episode each) and ``TRAIN_SIZE`` in the RL prompts, all disjoint.

    python examples/real/agent/tool_task.py    # (re)writes examples/real/agent/data/*.jsonl
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from pathlib import Path
from typing import Any

from geartrain.agents import ToolEnvironment

DATA_DIR = Path(__file__).resolve().parent / "data"
VALIDATION_SIZE = 200
DEV_SIZE = 32
TRACES = 64
TRAIN_SIZE = 3000
SPLIT_SEED = 2711

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calc(expression: str) -> str:
    """Evaluate integer arithmetic (+ - *)."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("only integers with + - * ( )")

    return str(ev(ast.parse(expression.strip(), mode="eval").body))


class Calculator(ToolEnvironment):
    """The ``calc`` tool in the Hermes call format. ``enabled = false`` (the control job)
    offers no tool: a call the model still makes is answered with an error."""

    def __init__(self, enabled: bool = True, timeout_s: float = 2.0) -> None:
        super().__init__([calc] if enabled else [], call_format="hermes", timeout_s=timeout_s)


def system_prompt() -> str:
    """The system turn of the tool job: the Hermes tool listing, ``calc``'s spec as geartrain
    hands it to chat templates (``Calculator().tools``) inside ``<tools></tools>``, and the
    call's shape, in Qwen2.5's words shortened (every prompt token costs on 2 CPU cores)."""
    specs = "\n".join(json.dumps(spec) for spec in Calculator().tools)
    return (
        f"You may call functions to answer. Function signatures:\n<tools>\n{specs}\n</tools>\n"
        'Call one as:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def questions() -> list[tuple[str, str, int]]:
    """``(kind, question, answer)`` for every question, in a fixed order."""
    out: list[tuple[str, str, int]] = []
    for a in range(11, 100):
        for b in range(11, 100):
            out.append(("product", f"What is {a} times {b}?", a * b))
    rng = random.Random(SPLIT_SEED + 1)
    for _ in range(len(out)):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        out.append(("sum", f"What is {a} + {b}?", a + b))
    return out


def expression(question: str) -> str:
    """The calculator expression of a question: ``"What is 47 times 86?"`` -> ``"47 * 86"``."""
    a, op, b = re.fullmatch(r"What is (\d+) (times|\+) (\d+)\?", question).groups()  # type: ignore[union-attr]
    return f"{a} {'*' if op == 'times' else '+'} {b}"


def splits() -> dict[str, list[tuple[str, str, int]]]:
    """Disjoint ``val``, ``sft_dev``, ``traces`` and ``train``; each split half products,
    half sums, the same on every machine."""
    items = questions()
    by_kind = {k: [q for q in items if q[0] == k] for k in ("product", "sum")}
    out: dict[str, list[tuple[str, str, int]]] = {"val": [], "sft_dev": [], "traces": [], "train": []}
    for kind, qs in by_kind.items():
        random.Random(f"{SPLIT_SEED}-{kind}").shuffle(qs)
        v, d, t = VALIDATION_SIZE // 2, DEV_SIZE // 2, TRACES // 2
        out["val"] += qs[:v]
        out["sft_dev"] += qs[v : v + d]
        out["traces"] += qs[v + d : v + d + t]
        out["train"] += qs[v + d + t : v + d + t + TRAIN_SIZE // 2]
    for name, rows in out.items():
        random.Random(f"{SPLIT_SEED}-{name}").shuffle(rows)
    return out


def row(kind: str, question: str, answer: int) -> dict[str, Any]:
    return {"prompt": question, "ground_truth": str(answer), "kind": kind}


def trace(kind: str, question: str, answer: int) -> dict[str, Any]:
    """One correct episode: the call, the tool's result (the tool turn's content), the answer."""
    call = json.dumps({"name": "calc", "arguments": {"expression": expression(question)}})
    return {
        **row(kind, question, answer),
        "turns": [
            {"role": "model", "text": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "observation", "text": str(answer)},
            {"role": "model", "text": f"The answer is {answer}."},
        ],
    }


def write(data_dir: Path = DATA_DIR) -> dict[str, Path]:
    """Write ``train``, ``val`` (held out), ``sft_dev`` and ``traces`` as JSONL."""
    data_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, items in splits().items():
        make = trace if name == "traces" else row
        path = data_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(make(*q)) + "\n" for q in items))
        paths[name] = path
    return paths


_INTEGER = re.compile(r"-?\d+")


def final_answer(response: str) -> int | None:
    """The last integer the response states (thousands separators ignored), or ``None``."""
    found = _INTEGER.findall(response.replace(",", ""))
    return int(found[-1]) if found else None


def final_answer_match(response: str, ground_truth: str, *, meta: dict[str, Any]) -> dict[str, float]:
    """1 when the episode's last model turn ends on the right number, else 0 (``acc`` the
    same); the episode's tool use rides along: ``called`` (it made a call), ``tool_ok``
    (a call ran and gave a result)."""
    correct = final_answer(response) == int(ground_truth)
    calls = meta.get("episode", {}).get("calls", [])
    return {
        "score": float(correct),
        "acc": float(correct),
        "called": float(bool(calls)),
        "tool_ok": float(any(c["ok"] for c in calls)),
    }


if __name__ == "__main__":
    for name, path in write().items():
        print(f"{name}: {path} ({sum(1 for _ in path.open())} rows)")
