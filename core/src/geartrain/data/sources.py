"""Reading raw rows from JSONL, JSON, Parquet, CSV, a directory of such files, a dataset
saved by ``datasets``, a ``datasets.Dataset`` or a list of dicts, each with its 1-based row
number (the line number for JSONL and CSV) for error messages. No downloads."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from geartrain.errors import DataError, without_python_advice

logger = logging.getLogger(__name__)

#: What a dataset can be built from: a file path, a ``datasets.Dataset`` or rows in memory.
DataSource = str | Path | Any


def source_name(source: DataSource) -> str:
    if isinstance(source, str | Path):
        return str(source)
    if isinstance(source, Sequence):
        return "<rows in memory>"
    name = getattr(getattr(source, "info", None), "dataset_name", None)
    return f"<datasets.Dataset {name}>" if name else "<datasets.Dataset>"


#: File suffixes a data path may have (a directory holds files of these, or a dataset
#: saved with ``datasets.Dataset.save_to_disk``).
SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")

HUB_HINT = (
    "hub datasets are not downloaded by geartrain: save it with "
    "`datasets.load_dataset(...).save_to_disk(dir)` (or write .jsonl/.parquet) and give that path"
)


def looks_like_hub_id(text: str) -> bool:
    """Whether ``text`` reads as a hub id (``gsm8k``, ``openai/gsm8k``) rather than a path:
    no known suffix, not absolute or explicitly relative, at most one ``/``."""
    path = Path(text)
    return path.suffix not in SUFFIXES and not text.startswith(("/", ".", "~")) and len(path.parts) <= 2


def read_rows(source: DataSource) -> Iterator[tuple[str, Any]]:
    """Yield ``(where, row)``, ``where`` naming the source and the 1-based row
    (``"train.jsonl, line 7"``: JSONL counts lines, blank ones skipped; ``"train.parquet,
    row 7"`` otherwise).

    A path is a ``.jsonl``, ``.json`` (an array of objects, or one object per line),
    ``.parquet`` or ``.csv`` file, a directory of such files (read in name order; hidden ones
    skipped, and one that looks like data but would not be read refused), or a
    directory written by ``datasets``' ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict``
    with a ``train`` split). Raises :class:`DataError` for a missing path (a hub id gets the
    hint to save it to disk first: nothing is downloaded), an unknown suffix or a row that
    does not parse."""
    if isinstance(source, str | Path):
        path = Path(os.path.expanduser(source))
        if path.is_dir():
            yield from _directory(path)
        elif path.exists() and not path.is_file():  # a FIFO, a device, a socket: reading could block forever
            raise DataError(
                f"{path}: not a regular file or a directory (a pipe, device or socket); give a data file or a directory"
            )
        elif not path.is_file():
            if looks_like_hub_id(str(source)):
                raise DataError(f"{source}: no such file or directory; if it is a Hugging Face hub id, {HUB_HINT}")
            raise DataError(f"{path}: no such data file")
        else:
            yield from _file(path)
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
        f"cannot read prompts from {type(source).__name__}; give a .jsonl/.json/.parquet/.csv path, a directory, "
        "a datasets.Dataset or a list of dicts"
    )


def _file(path: Path) -> Iterator[tuple[str, Any]]:
    if path.suffix == ".jsonl":
        yield from _jsonl(path)
    elif path.suffix == ".json":
        yield from _json(path)
    elif path.suffix == ".parquet":
        yield from _parquet(path)
    elif path.suffix == ".csv":
        yield from _csv(path)
    else:
        raise DataError(
            f"{path}: unknown data format '{path.suffix}'; use {', '.join(SUFFIXES)} or a directory of them"
        )


def _directory(path: Path) -> Iterator[tuple[str, Any]]:
    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        yield from _saved_dataset(path)
        return
    entries = sorted(path.iterdir())
    # hidden files are no data (macOS's ._name copies, editors' swap files), as for datasets
    files = [p for p in entries if p.is_file() and p.suffix in SUFFIXES and not p.name.startswith(".")]
    unread = [why for p in entries if (why := _unread_data(p)) is not None]
    if unread:  # reading the rest would train on part of what was put there, without a word
        raise DataError(
            f"{path}: a data directory is read from its {', '.join(SUFFIXES)} files only, and these look like data "
            f"it would leave out: {'; '.join(unread)}"
        )
    if not files:
        raise DataError(
            f"{path}: a directory with no {', '.join(SUFFIXES)} files and no dataset saved by datasets' save_to_disk"
        )
    files = _train_split(path, files)
    for file in files:
        yield from _file(file)


#: A file name's split, as a hub snapshot names its files (``train-00000-of-00001.parquet``).
_SPLIT = re.compile(r"^(train|test|validation|valid|dev|eval)(?=[-_.])", re.IGNORECASE)


def _train_split(path: Path, files: list[Path]) -> list[Path]:
    """The files of a data directory a run trains on: all of them, unless their names give
    more than one split (a hub snapshot's train-*.parquet and test-*.parquet), then the train
    split's, the others named once (read as one, the test split became training prompts,
    silently). Several splits and no train split: :class:`DataError`."""
    split_of = {f: (m.group(1).lower() if (m := _SPLIT.match(f.name)) else None) for f in files}
    splits = sorted({s for s in split_of.values() if s is not None})
    if len(splits) < 2:
        return files
    if "train" not in splits:
        raise DataError(
            f"{path}: its file names give the splits {', '.join(splits)} and no train split; give the directory "
            "(or file) of the split to train on"
        )
    left = [f.name for f, s in split_of.items() if s != "train"]
    logger.warning(
        "%s: its file names give the splits %s: training reads the train split's %d file(s), not %s",
        path,
        ", ".join(splits),
        len(files) - len(left),
        ", ".join(left[:5]) + (", ..." if len(left) > 5 else ""),
    )
    return [f for f, s in split_of.items() if s == "train"]


#: Suffixes of compressed files (``train.jsonl.gz``): not read, so named when they hold data.
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zip")


def _unread_data(entry: Path) -> str | None:
    """Why ``entry`` of a data directory, which looks like data, is not read (``None``: it is
    read, or does not look like data: a README, a hidden file)."""
    name = entry.name
    if name.startswith("."):
        return None
    suffix = entry.suffix
    if suffix in SUFFIXES and not entry.is_file():
        if entry.is_dir():
            return f"{name} (a directory)"
        if entry.is_symlink():
            return f"{name} (a link to a file that does not exist)"
        return f"{name} (not a regular file)"
    if suffix.lower() in SUFFIXES and suffix not in SUFFIXES:
        return f"{name} (give the suffix in lower case: {suffix.lower()})"
    if suffix.lower() in COMPRESSED and Path(entry.stem).suffix.lower() in SUFFIXES:
        return f"{name} (compressed: decompress it)"
    if entry.is_dir() and any(p.suffix.lower() in SUFFIXES for p in entry.iterdir()):
        return f"{name}/ (a subdirectory of data files: only the top level is read; give it as a path of its own)"
    return None


def _saved_dataset(path: Path) -> Iterator[tuple[str, Any]]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises several types for a damaged directory
        raise DataError(f"{path}: not a readable dataset saved with save_to_disk ({exc})") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(
                f"{path}: a DatasetDict without a 'train' split (splits: {', '.join(loaded)}); "
                f"give the split's directory, e.g. {path / next(iter(loaded))}"
            )
        loaded = loaded["train"]
    for row_no, row in enumerate(loaded, start=1):
        yield f"{path}, row {row_no}", row


# "utf-8-sig": a file saved with a byte-order mark (Windows editors, Excel) reads as UTF-8;
# without it the mark would glue onto the first JSON value or the first CSV column name.


# A JSON escape of a UTF-16 surrogate (\\ud800-\\udfff). Decoded UTF-8 text holds no
# surrogates, so only such an escape can put one in a row; alone (half a pair) it is no
# character, and every tokenizer (and UTF-8 writer) refuses it far from the data file.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse_lone_surrogates(where: str, row: Any, key: str | None = None) -> None:
    """Raise :class:`DataError` naming ``where`` and the key if any string in ``row`` (a parsed
    JSON value, walked through lists and objects) holds a lone surrogate; else return."""
    if isinstance(row, str):
        found = _LONE_SURROGATE.search(row)
        if found:
            name = f"{key!r}" if key is not None else "the row"
            raise DataError(
                f"{where}: {name} holds a lone UTF-16 surrogate escape (\\u{ord(found.group()):04x}), which is "
                "no character; write the character itself or a complete surrogate pair"
            )
    elif isinstance(row, dict):
        for k, v in row.items():
            _refuse_lone_surrogates(where, k, key)
            _refuse_lone_surrogates(where, v, key if key is not None else str(k))
    elif isinstance(row, list):
        for v in row:
            _refuse_lone_surrogates(where, v, key)


def _decode(path: Path, raw: bytes, encoding: str) -> str:
    """``raw`` (the whole file) as text; :class:`DataError` naming the line and column of
    the first byte that is not UTF-8."""
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise DataError(
            f"{path}, line {line}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {column}); save the file as UTF-8"
        ) from None


class _NotStrictJson(ValueError):
    """Text Python's ``json`` reads by default and JSON does not mean: ``NaN`` and ``Infinity``
    (a ground truth no response can match), or a key given twice in one object (all but the
    last value silently dropped)."""


def _no_constant(name: str) -> Any:
    raise _NotStrictJson(f"{name} is not a JSON value; write null, a number or a string")


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    row = dict(pairs)
    if len(row) != len(pairs):
        seen: set[str] = set()
        repeated = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise _NotStrictJson(f"key {repeated!r} given twice in one object (only the last would be read)")
    return row


#: ``json.loads`` options that refuse what :class:`_NotStrictJson` names
_STRICT = {"parse_constant": _no_constant, "object_pairs_hook": _no_repeated_keys}


def _not_json(where: str, exc: ValueError | RecursionError) -> DataError:
    """The error for each way ``json.loads`` refuses text: bad syntax, nesting deeper than
    Python's recursion limit, an integer of more digits than ``int`` converts, what JSON does
    not mean (:class:`_NotStrictJson`)."""
    if isinstance(exc, json.JSONDecodeError):
        return DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})")
    if isinstance(exc, _NotStrictJson):
        return DataError(f"{where}: {exc}")
    if isinstance(exc, RecursionError):
        return DataError(f"{where}: JSON nested too deeply to read (arrays or objects in each other)")
    # an integer beyond sys.get_int_max_str_digits(): Python's advice to raise it is not the user's to take
    return DataError(f"{where}: not readable JSON ({without_python_advice(exc)})")


def _loads(where: str, text: str) -> Any:
    """``json.loads(text)``; a refusal is a :class:`DataError` naming ``where``."""
    try:
        return json.loads(text, **_STRICT)
    except (RecursionError, ValueError) as exc:
        raise _not_json(where, exc) from None


def _json(path: Path) -> Iterator[tuple[str, Any]]:
    text = _decode(path, path.read_bytes(), "utf-8-sig")
    if not text.lstrip().startswith("["):
        yield from _jsonl(path)  # one object per line
        return
    try:
        rows = json.loads(text, **_STRICT)
    except (RecursionError, ValueError) as exc:
        where = f"{path}, line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else str(path)
        raise _not_json(where, exc) from None
    escapes = _SURROGATE_ESCAPE.search(text) is not None
    for row_no, row in enumerate(rows, start=1):
        where = f"{path}, item {row_no}"
        if escapes:
            _refuse_lone_surrogates(where, row)
        yield where, row


def _csv(path: Path) -> Iterator[tuple[str, Any]]:
    import csv
    import io
    import sys

    text = _decode(path, path.read_bytes(), "utf-8-sig")
    reader = csv.DictReader(io.StringIO(text, newline=""))
    limit = csv.field_size_limit()
    # a long prompt is a cell of any size (dropped later by data.max_prompt_length, as in
    # JSONL), not the csv module's 128 KiB refusal; the module's limit is put back at once
    csv.field_size_limit(sys.maxsize)
    rows: list[tuple[int, dict[Any, Any]]] = []  # (the row's last line: blank lines are skipped, the row)
    try:
        header = reader.fieldnames or []
        seen: dict[str, int] = {}
        for column, name in enumerate(header, start=1):
            if name in seen:  # DictReader keeps the last one's cells under the name: silently
                raise DataError(
                    f"{path}, line 1: column {name!r} appears twice (columns {seen[name]} and {column}); "
                    "name each column once"
                )
            seen[name] = column
        for row in reader:
            rows.append((reader.line_num, row))
    except csv.Error as exc:
        raise DataError(f"{path}, line {reader.line_num}: not valid CSV ({exc})") from None
    finally:
        csv.field_size_limit(limit)
    for line_no, row in rows:
        where = f"{path}, line {line_no}"
        extra, cells = row.pop(None, None), len(header)
        if extra is not None or any(value is None for value in row.values()):
            # DictReader drops nothing visibly: a cell too many goes under a key None, a cell
            # too few reads as missing (an unquoted comma in a prompt shifts every cell after it)
            found = cells + len(extra) if extra is not None else sum(value is not None for value in row.values())
            raise DataError(
                f"{where}: {found} cells where the header has {cells}; "
                'a cell holding a comma or a line break must be quoted ("like, this")'
            )
        # an empty cell is how pandas (and spreadsheets) write a missing value: null, as JSONL's
        # null, not the text "" (an empty ground truth no response can match)
        yield where, {key: (None if value == "" else value) for key, value in row.items()}


def _jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                # -sig on every line: files joined with `cat` keep each one's byte-order mark
                line = raw.decode("utf-8-sig")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}, line {line_no}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                    "save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                row = _loads(f"{path}, line {line_no}", line)
            except DataError as exc:
                if "\r" in line.rstrip("\r\n"):  # a file from classic Mac OS: one "line" holds them all
                    raise DataError(
                        f"{exc}; the file's lines end in a lone CR (classic Mac OS line ends): "
                        "save it with LF (or CRLF) line ends"
                    ) from None
                raise
            if _SURROGATE_ESCAPE.search(line):
                _refuse_lone_surrogates(f"{path}, line {line_no}", row)
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
