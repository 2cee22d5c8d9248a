"""Reading a model directory's weight files without loading them: what is wrong with its
safetensors files, from their headers alone (shared by the model's checks and the GGUF
cache's, which both read model directories)."""

from __future__ import annotations

import json
from pathlib import Path


def unreadable_safetensors_problem(path: str) -> str | None:
    """What is wrong with the ``*.safetensors`` files of the local model directory ``path``,
    read from their headers only (no tensor is loaded): a damaged header, a file that is
    not safetensors, a sharded model's index that is damaged or names a shard the directory
    lacks (``None``: every file opens, or ``path`` is no local directory)."""
    from safetensors import safe_open

    directory = Path(path)
    if not directory.is_dir():
        return None
    for index in sorted(directory.glob("*.safetensors.index.json")):
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted({str(name) for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"{index} cannot be read ({type(exc).__name__}: {exc}): the sharded model's index is damaged"
        missing = [name for name in shards if not (directory / name).is_file()]
        if missing:
            return (
                f"{index} names {len(missing)} of its {len(shards)} weight files that are not in {directory} "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): the model is incomplete (a shard "
                "was not downloaded or copied); copy the whole model directory"
            )
    for file in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                handle.keys()
        except Exception as exc:  # noqa: BLE001 - safetensors' own error types; any is the file's
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"{file} cannot be read ({why}): it is damaged or not a safetensors file; restore it from a copy"
    return None
