"""The main job composed in Python (examples/arithmetic/train.py) runs the same pipeline."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from e2e_helpers import JOB_HANG_GUARD_S, QUICK, ROOT, rl_records

pytestmark = pytest.mark.e2e


def test_python_api_example_runs_the_pipeline(out_dir: Path) -> None:
    script = ROOT / "examples" / "arithmetic" / "train.py"
    overrides = [*QUICK, "trainer.total_steps=3", "sft.min_steps=0", f"trainer.output_dir={out_dir}"]
    proc = subprocess.run(
        [sys.executable, str(script), *overrides], cwd=ROOT, capture_output=True, text=True, timeout=JOB_HANG_GUARD_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "accuracy before GRPO: " in proc.stdout and "gain: " in proc.stdout
    assert [r["step"] for r in rl_records(out_dir / "metrics.jsonl")] == [0, 1, 2, 3]
    assert (out_dir / "sft_model" / "config.json").exists() and (out_dir / "curves.png").exists()
