"""Tool use and accuracy of the agent jobs' held-out episodes, before and after training.

Reads the greedy validation episodes a run wrote to ``<output_dir>/completions.jsonl`` (every
held-out question, at its first and its last validation) and prints one Markdown row per run
and validation: the share of episodes that

* **called**: wrote ``<tool_call>`` in some model turn;
* **well-formed**: made a call the Hermes parser reads as ``calc`` with a string
  ``expression`` (no malformed call in the episode);
* **tool ok**: had a call parsed and executed (the tool turn after it holds a result, not
  an error);
* **accuracy**: ended on the right number (the job's reward), also per kind of question.

    python examples/real/agent/evaluate.py outputs/real_agent_tool outputs/real_agent_notool
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from geartrain.agents.formats import HermesFormat

_HERMES = HermesFormat()
COLUMNS = ("called", "well_formed", "tool_ok", "accuracy", "product", "sum")


def episode_stats(record: Mapping[str, Any]) -> dict[str, float]:
    """The per-episode indicators (1.0 / 0.0) of one validation record (see the module
    docstring); ``product`` / ``sum`` hold its accuracy under its kind's key only."""
    turns: Sequence[Mapping[str, str]] = record.get("turns") or [{"role": "model", "text": record["response"]}]
    called = well_formed = tool_ok = malformed = False
    for i, turn in enumerate(turns):
        if turn["role"] != "model":
            continue
        called |= "<tool_call>" in turn["text"]
        calls, errors = _HERMES.parse(turn["text"])
        malformed |= bool(errors)
        good = [c for c in calls if c.name == "calc" and isinstance(c.arguments.get("expression"), str)]
        well_formed |= bool(good)
        following = turns[i + 1] if i + 1 < len(turns) else None
        if calls and following is not None and following["role"] == "observation":
            tool_ok |= not following["text"].lstrip().startswith("error:")
    right = float(record["reward"] >= 0.5)
    kind = "product" if " times " in record["prompt"] else "sum"
    return {
        "called": float(called),
        "well_formed": float(well_formed and not malformed),
        "tool_ok": float(tool_ok),
        "accuracy": right,
        kind: right,
    }


def summarize(records: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Means of :func:`episode_stats` over ``records`` (kinds over their own episodes),
    with ``n``, the number of episodes."""
    rows = [episode_stats(r) for r in records]
    out: dict[str, float] = {"n": float(len(rows))}
    for key in COLUMNS:
        values = [r[key] for r in rows if key in r]
        out[key] = sum(values) / len(values) if values else float("nan")
    return out


def validations(run: Path) -> dict[int, list[dict[str, Any]]]:
    """The run's validation records by training step (0: before training)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for line in (run / "completions.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "validation":
            out.setdefault(record["step"], []).append(record)
    return out


def table(runs: Sequence[Path]) -> str:
    """A Markdown table: a row per run and validation (first and last)."""
    lines = [
        "| run | step | n | called | well-formed | tool ok | accuracy | products | sums |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        by_step = validations(run)
        for step in sorted({min(by_step), max(by_step)}):
            s = summarize(by_step[step])
            cells = " | ".join(f"{100 * s[k]:.1f} %" for k in COLUMNS)
            lines.append(f"| {run.name} | {step} | {int(s['n'])} | {cells} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: evaluate.py RUN_DIR [RUN_DIR ...]")
    print(table([Path(p) for p in sys.argv[1:]]))
