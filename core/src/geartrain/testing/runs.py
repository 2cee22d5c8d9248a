"""A finished run's directory for tests of what may touch it (``--overwrite``, export),
and a fingerprint of a directory to show that nothing in it changed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from geartrain.checkpoint import CheckpointManager
from geartrain.trainer.config import TrainConfig


def file_tree(root: Path) -> dict[str, str]:
    """SHA-256 of every file under ``root``, by path relative to it."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def write_finished_run(config: TrainConfig, step: int) -> dict[str, str]:
    """The files a run of ``config`` leaves in its (new) ``trainer.output_dir`` after ``step``
    steps (its config, a metrics record, an actor checkpoint); returns their :func:`file_tree`."""
    out = Path(config.trainer.output_dir)
    out.mkdir(parents=True)
    (out / "config.json").write_text(config.model_dump_json(indent=2))
    (out / "metrics.jsonl").write_text(json.dumps({"phase": "rl", "step": step}) + "\n")
    CheckpointManager(out / "checkpoints" / "actor").save(step, lambda d: (d / "state.bin").write_bytes(b"x" * 64))
    return file_tree(out)
