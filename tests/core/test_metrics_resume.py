"""metrics.jsonl on --resume: the records after the checkpoint go, and a gap before it is
named (probe of issue 35: a file cut by hand resumed with a silent gap in its curves)."""

from __future__ import annotations

import json
from pathlib import Path

from geartrain.trainer.metrics import JsonlLogger, read_jsonl, step_ranges


def _write(path: Path, steps: list[int], *, cut_last: bool = False) -> None:
    lines = [json.dumps({"phase": "sft", "step": 20, "sft/loss": 1.0})]
    lines += [json.dumps({"phase": "rl", "step": s, "reward/mean": s / 10}) for s in steps]
    text = "".join(line + "\n" for line in lines)
    path.write_text(text[:-7] if cut_last else text)


def test_resume_keeps_the_records_up_to_the_checkpoint_and_names_no_gap(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _write(path, list(range(0, 13)), cut_last=True)
    log = JsonlLogger(path, resume_step=10)
    log.close()
    assert log.missing_rl_steps == []
    assert [(r["phase"], r["step"]) for r in read_jsonl(path)] == [("sft", 20)] + [("rl", s) for s in range(11)]


def test_resume_names_the_steps_a_cut_file_lost(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _write(path, [0, 1, 2, 3, 5, 6])
    log = JsonlLogger(path, resume_step=10)
    log.close()
    assert log.missing_rl_steps == [4, 7, 8, 9, 10]
    assert step_ranges(log.missing_rl_steps) == "4, 7-10"
    path.unlink()
    log = JsonlLogger(path, resume_step=3)
    log.close()
    assert log.missing_rl_steps == [1, 2, 3]
    assert JsonlLogger(tmp_path / "fresh.jsonl").missing_rl_steps == []
