"""Write GSM8K as the Parquet files the recipe reads (``~/data/gsm8k/{train,test}.parquet``).

    pip install datasets            # geartrain itself downloads nothing
    python examples/gsm8k/prepare_data.py                    # from the hub: openai/gsm8k, config "main"
    python examples/gsm8k/prepare_data.py --from-disk DIR    # a DatasetDict saved with save_to_disk
    python examples/gsm8k/prepare_data.py --out ~/data/gsm8k

Each row becomes ``prompt`` (the question and the instruction to end with ``#### <answer>``)
and ``ground_truth`` (the number after ``####`` in GSM8K's worked answer), which the
``gsm8k`` reward compares with the number after the response's last ``####``.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

INSTRUCTION = "Let's think step by step and output the final answer after '####'."


def convert(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """GSM8K rows (``question``, ``answer`` ending in ``#### N``) as geartrain rows."""
    out = []
    for row in rows:
        answer = str(row["answer"]).rsplit("####", 1)[-1].strip().replace(",", "")
        out.append({"prompt": f"{row['question']} {INSTRUCTION}", "ground_truth": answer})
    return out


def write_split(rows: Iterable[Mapping[str, Any]], path: Path) -> Path:
    """Convert ``rows`` and write them to the Parquet file ``path``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(convert(rows)), path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="~/data/gsm8k", help="directory of train.parquet and test.parquet")
    parser.add_argument("--from-disk", help="a DatasetDict saved with save_to_disk instead of the hub")
    args = parser.parse_args()
    import datasets

    splits = (
        datasets.load_from_disk(args.from_disk) if args.from_disk else datasets.load_dataset("openai/gsm8k", "main")
    )
    out = Path(args.out).expanduser()
    for split in ("train", "test"):
        print(f"{write_split(splits[split], out / f'{split}.parquet')}: {len(splits[split])} rows")


if __name__ == "__main__":
    main()
