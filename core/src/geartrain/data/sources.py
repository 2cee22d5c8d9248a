"""Reading raw rows from JSONL, Parquet or a ``datasets.Dataset``, each with its 1-based
row number (the line number for JSONL) for error messages. No downloads."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from geartrain.errors import DataError

#: What a dataset can be built from: a file path, a ``datasets.Dataset`` or rows in memory.
DataSource = str | Path | Any


def source_name(source: DataSource) -> str:
    if isinstance(source, str | Path):
        return str(source)
    if isinstance(source, Sequence):
        return "<rows in memory>"
    name = getattr(getattr(source, "info", None), "dataset_name", None)
    return f"<datasets.Dataset {name}>" if name else "<datasets.Dataset>"


def read_rows(source: DataSource) -> Iterator[tuple[str, Any]]:
    """Yield ``(where, row)``, ``where`` naming the source and the 1-based row
    (``"train.jsonl, line 7"``: JSONL counts lines, blank ones skipped; ``"train.parquet,
    row 7"`` otherwise). Raises :class:`DataError` for a missing file, an unknown suffix or a
    line that is not JSON."""
    if isinstance(source, str | Path):
        path = Path(source)
        if not path.is_file():
            raise DataError(f"{path}: no such data file")
        if path.suffix == ".jsonl":
            yield from _jsonl(path)
        elif path.suffix == ".parquet":
            yield from _parquet(path)
        else:
            raise DataError(f"{path}: unknown data format '{path.suffix}'; use .jsonl or .parquet")
        return
    name = source_name(source)
    if isinstance(source, Sequence) and not isinstance(source, str | bytes):
        for row_no, row in enumerate(source, start=1):
            yield f"{name}, row {row_no}", row
        return
    if hasattr(source, "column_names") and hasattr(source, "__iter__"):  # datasets.Dataset
        for row_no, row in enumerate(iter(source), start=1):
            yield f"{name}, row {row_no}", row
        return
    raise DataError(
        f"cannot read prompts from {type(source).__name__}; give a .jsonl/.parquet path or a datasets.Dataset"
    )


def _jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}, line {line_no}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                    "save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}, line {line_no}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            yield f"{path}, line {line_no}", row


def _parquet(path: Path) -> Iterator[tuple[str, Mapping[str, Any]]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from exc
    row_no = 0
    for batch in parquet.iter_batches():
        for row in batch.to_pylist():
            row_no += 1
            yield f"{path}, row {row_no}", row
