"""Checkpoint manifests: the size and SHA-256 of every file a checkpoint holds.

:class:`geartrain.CheckpointManager` writes ``MANIFEST.json`` into every checkpoint after
the backend has written its files and before the ``COMPLETE`` marker, whatever the backend.
:func:`verify_manifest` re-reads the files and lists what differs, so a damaged checkpoint
(a truncated or overwritten shard, a missing file) is named before anything is loaded from
it, and resume can fall back to an older, intact checkpoint.

The manifest lists every file a load may read: a file in the directory that the manifest
does not list (an emptied, partial or hand-edited manifest) is a problem too, so nothing
outside the manifest is ever opened. A checkpoint whose files do not match its manifest is
never loaded. (What the files may contain is checked separately: no pickle in a checkpoint
is read with code-running semantics, see :mod:`geartrain.dcp_guard` and
:func:`geartrain.load_state`.)
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "MANIFEST.json"
_VERSION = 1
_CHUNK = 1 << 20


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(directory: Path, exclude: frozenset[str]) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.relative_to(directory).as_posix() not in exclude)


def write_manifest(directory: str | Path, *, exclude: frozenset[str] = frozenset()) -> Path:
    """Record every file under ``directory`` (except ``exclude``, relative POSIX paths, and
    the manifest itself) in ``directory/MANIFEST.json``; fsynced. Returns its path."""
    directory = Path(directory)
    skip = exclude | {MANIFEST}
    files = {
        p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in _files(directory, skip)
    }
    path = directory / MANIFEST
    with path.open("w", encoding="utf-8") as fh:
        json.dump({"version": _VERSION, "files": files}, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    return path


def record_new_files(directory: str | Path, *, exclude: frozenset[str] = frozenset()) -> list[str]:
    """Add the files under ``directory`` its manifest does not list yet (except ``exclude``)
    to ``directory/MANIFEST.json``, written anew beside it and moved over it (a cut leaves the
    old one whole); the files already listed are neither read nor hashed again. Returns the
    names added (empty: nothing to add, or no readable manifest to add to)."""
    directory = Path(directory)
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return []
    new = [p for p in _files(directory, exclude | {MANIFEST}) if p.relative_to(directory).as_posix() not in files]
    if not new:
        return []
    for p in new:
        files[p.relative_to(directory).as_posix()] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    tmp = directory / f".{MANIFEST}.tmp"
    with tmp.open("w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return [p.relative_to(directory).as_posix() for p in new]


#: written after the manifest (the checkpoint's ``COMPLETE`` marker), so never in it
WRITTEN_AFTER = frozenset({"COMPLETE"})


def verify_manifest(directory: str | Path, *, exclude: frozenset[str] = WRITTEN_AFTER) -> list[str]:
    """Problems of ``directory`` against its manifest, one sentence each, naming the file
    (empty: every recorded file is there with its size and hash, and every file in the
    directory but ``exclude`` and the manifest itself is recorded)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        return [f"{MANIFEST} is missing (every geartrain checkpoint has one, written before its COMPLETE marker)"]
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))["files"]
        entries = {str(name): (int(e["size"]), str(e["sha256"])) for name, e in recorded.items()}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return [f"{MANIFEST} is unreadable ({type(exc).__name__}: {exc})"]
    problems = []
    unlisted = [p.relative_to(directory).as_posix() for p in _files(directory, exclude | {MANIFEST})]
    unlisted = [name for name in unlisted if name not in entries]
    if unlisted:
        shown = ", ".join(unlisted[:5]) + (f" and {len(unlisted) - 5} more" if len(unlisted) > 5 else "")
        problems.append(
            f"{shown} {'is' if len(unlisted) == 1 else 'are'} not in {MANIFEST} (it must list every file a load reads: "
            "the manifest was emptied, cut short or rewritten, or files were added)"
        )
    for name, (size, sha) in sorted(entries.items()):
        file = directory / name
        if not file.is_file():
            problems.append(f"{name} is missing")
            continue
        actual = file.stat().st_size
        if actual != size:
            problems.append(f"{name} has {actual} bytes, the manifest says {size} (truncated or rewritten)")
            continue
        try:
            same = _sha256(file) == sha
        except OSError as exc:  # its permissions, or an I/O error: named, as a damaged file is
            problems.append(f"{name} cannot be read ({exc.strerror or exc})")
            continue
        if not same:
            problems.append(f"{name} does not match its SHA-256 in the manifest (its content was changed)")
    return problems
