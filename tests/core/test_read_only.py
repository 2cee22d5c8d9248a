"""Issue 35, item 11: a run directory on a read-only file system is one line and exit 2
for ``train --overwrite`` and ``train --resume`` (it was a 27-line EROFS traceback from the
lock code), and so is an export there.

The file system is really read-only: each command runs in a user and mount namespace
(``unshare -rm``) where the run directory is bind-mounted read-only over itself. Skipped
where the kernel allows no user namespaces."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from geartrain import CheckpointManager
from geartrain.trainer import load_train_config

ROOT = Path(__file__).resolve().parents[2]
MAIN_CONFIG = ROOT / "examples" / "arithmetic" / "grpo.toml"
SMALL = ["trainer.total_steps=4", "sft.enabled=false", "trainer.progress=false"]


#: ``train`` as the CLI runs it, less the plugin check (the core's environment has no engine):
#: every check in question happens before an engine is built; a GeartrainError is the CLI's
#: ``error: ...`` line and exit 2
TRAIN = """
import sys
from geartrain.errors import GeartrainError
from geartrain.trainer import load_train_config, run_job
config = load_train_config(sys.argv[1], sys.argv[2:-1], check_plugins=False)
try:
    run_job(config, resume=sys.argv[-1] == "--resume", overwrite=sys.argv[-1] == "--overwrite")
except GeartrainError as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)
"""


def _in_read_only(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` with ``directory`` mounted read-only."""
    script = (
        f'mount --bind "{directory}" "{directory}" && mount -o remount,ro,bind "{directory}" "{directory}" && exec "$@"'
    )
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", sys.executable, *args],
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.fixture
def finished_run(tmp_path: Path) -> Path:
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"], check=False).returncode:
        pytest.skip("no user namespaces here (unshare -rm)")
    out = tmp_path / "run"
    config = load_train_config(MAIN_CONFIG, [*SMALL, f"trainer.output_dir={out}"], check_plugins=False)
    out.mkdir()
    (out / "config.json").write_text(config.model_dump_json(indent=2))
    (out / "metrics.jsonl").write_text(json.dumps({"phase": "rl", "step": 0}) + "\n")
    (out / ".geartrain.lock").write_text("")  # a run that ended cleanly leaves its lock file empty
    CheckpointManager(out / "checkpoints" / "actor").save(2, lambda d: (d / "state.bin").write_bytes(b"x" * 64))
    return out


@pytest.mark.parametrize("mode", ["--overwrite", "--resume"])
def test_train_into_a_read_only_run_is_one_line(finished_run: Path, mode: str) -> None:
    done = _in_read_only(
        finished_run, "-c", TRAIN, str(MAIN_CONFIG), *SMALL, f"trainer.output_dir={finished_run}", mode
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"error: trainer.output_dir '{finished_run}' is on a read-only file system ({finished_run}); "
        "nothing was changed. Choose a writable trainer.output_dir"
    ), done.stderr
