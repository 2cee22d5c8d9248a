"""Issue 35, item 6, rerun on the run's other files: a disk that fills while a job writes
anything of its own (``metrics.jsonl`` and TensorBoard's events at step 0, the SFT warm
start's model), not only a checkpoint or the final export, is one line and exit 2 naming the
device, not a traceback (TensorBoard's writer thread printed one of its own).

The disk is a real tmpfs, mounted in a user and mount namespace (``unshare -rm``) around the
``geartrain`` process; skipped where the kernel allows no user namespaces."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from e2e_helpers import JOB_HANG_GUARD_S, MAIN_CONFIG, geartrain_cmd

SMALL = [
    "trainer.total_steps=2",
    "data.batch_size=4",
    "sampling.n=2",
    "validation.every_n_steps=0",
    "trainer.progress=false",
    "sft.steps=2",
    "sft.min_steps=0",
    "sft.eval_every=100",
]


def _on_tmpfs(size: str, mount: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``geartrain ARGS`` with ``mount`` a fresh tmpfs of ``size``."""
    script = f'mount -t tmpfs -o size={size} tmpfs "{mount}" && exec "$@"'
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", *geartrain_cmd(*args)],
        capture_output=True,
        text=True,
        check=False,
        timeout=JOB_HANG_GUARD_S,
    )


@pytest.mark.parametrize(
    ("size", "sft"), [("16k", "false"), ("1m", "true")], ids=["metrics-at-step-0", "sft-warm-start-model"]
)
def test_a_disk_that_fills_under_the_runs_own_files_is_one_line(tmp_path: Path, size: str, sft: str) -> None:
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"], check=False).returncode:
        pytest.skip("no user namespaces here (unshare -rm)")
    mount = tmp_path / "disk"
    mount.mkdir()
    out = mount / "run"
    done = _on_tmpfs(size, mount, "train", str(MAIN_CONFIG), *SMALL, f"sft.enabled={sft}", f"trainer.output_dir={out}")
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert errors == [
        f"error: no space left on tmpfs (mounted at {mount}) while writing the run's files in {out}; no checkpoint "
        "was completed; free space there, then start again with --overwrite"
    ], done.stderr[-3000:]
