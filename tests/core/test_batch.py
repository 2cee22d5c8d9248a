"""The batch type: splitting across ranks and putting back in the original order."""

from __future__ import annotations

import pytest
import torch
from geartrain.batch import Batch


def numbered(n: int) -> Batch:
    return Batch(
        {"input_ids": torch.arange(n * 3).view(n, 3), "score": torch.arange(n, dtype=torch.float32)},
        {"prompt": [f"p{i}" for i in range(n)]},
        {"prompt_length": 2},
    )


@pytest.mark.parametrize(("n", "chunks"), [(7, 3), (8, 2), (2, 4), (5, 1)])
def test_split_then_cat_is_the_identity(n: int, chunks: int) -> None:
    batch = numbered(n)
    pieces = batch.split(chunks)
    assert [len(p) for p in pieces] == [n // chunks + (1 if i < n % chunks else 0) for i in range(chunks)]
    back = Batch.cat(pieces)
    assert torch.equal(back["input_ids"], batch["input_ids"])
    assert back["prompt"] == batch["prompt"]
    assert back.info == {"prompt_length": 2}


def test_index_reorders_tensors_and_meta_together() -> None:
    batch = numbered(4).index([3, 1, 0, 2])
    assert batch["score"].tolist() == [3.0, 1.0, 0.0, 2.0]
    assert batch["prompt"] == ["p3", "p1", "p0", "p2"]
    assert batch["input_ids"][0].tolist() == [9, 10, 11]


def test_repeat_interleave_is_prompt_major() -> None:
    batch = numbered(2).repeat_interleave(3)
    assert batch["prompt"] == ["p0", "p0", "p0", "p1", "p1", "p1"]
    assert batch["score"].tolist() == [0, 0, 0, 1, 1, 1]


def test_union_adds_fields_and_checks_rows() -> None:
    a = numbered(3)
    b = Batch({"adv": torch.ones(3, 3)}, {"reward": [1, 2, 3]})
    both = a.union(b)
    assert set(both.tensor_keys()) == {"input_ids", "score", "adv"}
    assert both["reward"] == [1, 2, 3]
    with pytest.raises(ValueError, match="cannot union"):
        a.union(numbered(2))


def test_inconsistent_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="disagree on the batch size"):
        Batch({"a": torch.zeros(2, 1), "b": torch.zeros(3, 1)})
    batch = numbered(2)
    with pytest.raises(ValueError, match="has 3 rows"):
        batch["x"] = torch.zeros(3)
    with pytest.raises(ValueError, match="has 1 entries"):
        batch["tag"] = ["only-one"]


def test_split_by_sizes_and_select() -> None:
    batch = numbered(5)
    parts = batch.split_by_sizes([1, 4])
    assert [len(p) for p in parts] == [1, 4]
    with pytest.raises(ValueError, match="add up to 3"):
        batch.split_by_sizes([1, 2])
    assert batch.select("score").tensor_keys() == ["score"]
