"""The batch type that flows between roles.

A :class:`Batch` is a set of per-sample tensors sharing the leading batch dimension (held
in a :class:`tensordict.TensorDict`), per-sample Python metadata (lists, one entry per
row: prompt text, ground truth, reward info...) and batch-wide ``info`` (prompt width,
temperature...). It splits into data-parallel or micro-batch chunks and concatenates back
in the original order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from geartrain.tensor_pickle import arrays_to_tensors, plain_cpu, tensors_to_arrays


class Batch:
    """Per-sample tensors + per-sample metadata + batch-wide info.

    ``batch["input_ids"]`` returns a tensor; ``batch["prompt"]`` a metadata list. Every
    tensor's first dimension and every metadata list's length equal ``len(batch)``.
    """

    __slots__ = ("tensors", "meta", "info")

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | TensorDict | None = None,
        meta: Mapping[str, Sequence[Any]] | None = None,
        info: Mapping[str, Any] | None = None,
        *,
        batch_size: int | None = None,
    ) -> None:
        if isinstance(tensors, TensorDict):
            td = tensors
        else:
            tensors = dict(tensors or {})
            if batch_size is None:
                sizes = {t.shape[0] for t in tensors.values()} | {len(v) for v in (meta or {}).values()}
                if len(sizes) > 1:
                    raise ValueError(f"batch fields disagree on the batch size: {sorted(sizes)}")
                batch_size = sizes.pop() if sizes else 0
            td = TensorDict(tensors, batch_size=[batch_size])
        self.tensors: TensorDict = td
        self.meta: dict[str, list[Any]] = {k: list(v) for k, v in (meta or {}).items()}
        self.info: dict[str, Any] = dict(info or {})
        for key, values in self.meta.items():
            if len(values) != len(self):
                raise ValueError(f"metadata '{key}' has {len(values)} entries for a batch of {len(self)}")

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return int(self.tensors.batch_size[0]) if self.tensors.batch_size else 0

    def __contains__(self, key: str) -> bool:
        return key in self.tensors.keys() or key in self.meta

    def __getitem__(self, key: str) -> Any:
        if key in self.meta:
            return self.meta[key]
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor | Sequence[Any]) -> None:
        if isinstance(value, torch.Tensor):
            if value.shape[0] != len(self):
                raise ValueError(f"tensor '{key}' has {value.shape[0]} rows for a batch of {len(self)}")
            self.tensors[key] = value
        else:
            value = list(value)
            if len(value) != len(self):
                raise ValueError(f"metadata '{key}' has {len(value)} entries for a batch of {len(self)}")
            self.meta[key] = value

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def tensor_keys(self) -> list[str]:
        return list(self.tensors.keys())

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}: {tuple(v.shape)}" for k, v in self.tensors.items())
        return f"Batch(size={len(self)}, tensors={{{fields}}}, meta={list(self.meta)}, info={self.info})"

    # ------------------------------------------------------------------ reshaping
    def index(self, rows: Sequence[int] | torch.Tensor | slice) -> Batch:
        """The rows ``rows`` (a slice, or indices in any order) as a new batch."""
        if isinstance(rows, slice):
            idx = list(range(len(self)))[rows]
        else:
            idx = [int(i) for i in rows]
        index_tensor = torch.tensor(idx, dtype=torch.long)
        td = self.tensors[index_tensor] if idx else self.tensors[:0]
        meta = {k: [v[i] for i in idx] for k, v in self.meta.items()}
        return Batch(td, meta, self.info)

    def split(self, chunks: int) -> list[Batch]:
        """``chunks`` contiguous pieces whose sizes differ by at most one (the first ones
        larger); ``Batch.cat`` of the result is the original batch."""
        if chunks < 1:
            raise ValueError("chunks must be >= 1")
        n = len(self)
        base, extra = divmod(n, chunks)
        pieces, start = [], 0
        for i in range(chunks):
            size = base + (1 if i < extra else 0)
            pieces.append(self.index(slice(start, start + size)))
            start += size
        return pieces

    def split_by_sizes(self, sizes: Iterable[int]) -> list[Batch]:
        pieces, start = [], 0
        for size in sizes:
            pieces.append(self.index(slice(start, start + size)))
            start += size
        if start != len(self):
            raise ValueError(f"sizes add up to {start}, batch has {len(self)} rows")
        return pieces

    @staticmethod
    def cat(batches: Sequence[Batch]) -> Batch:
        """Concatenate along the batch dimension; ``info`` comes from the first batch."""
        if not batches:
            return Batch()
        non_empty = [b for b in batches if len(b)] or [batches[0]]
        td = torch.cat([b.tensors for b in non_empty], dim=0) if len(non_empty) > 1 else non_empty[0].tensors
        meta_keys = list(batches[0].meta)
        meta = {k: [x for b in non_empty for x in b.meta[k]] for k in meta_keys}
        return Batch(td, meta, batches[0].info)

    def repeat_interleave(self, repeats: int) -> Batch:
        """Each row repeated ``repeats`` times in place (row i becomes rows i*r .. i*r+r-1)."""
        idx = [i for i in range(len(self)) for _ in range(repeats)]
        return self.index(idx)

    def union(self, other: Batch) -> Batch:
        """A batch with the fields of both (``other`` wins on equal names); same rows."""
        if len(other) != len(self):
            raise ValueError(f"cannot union batches of {len(self)} and {len(other)} rows")
        td = self.tensors.clone(recurse=False)
        td.update(other.tensors)
        return Batch(td, {**self.meta, **other.meta}, {**self.info, **other.info})

    def select(self, *keys: str) -> Batch:
        """Only the named tensor fields (metadata and info are kept)."""
        return Batch(self.tensors.select(*keys), self.meta, self.info)

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.tensors.to(device), self.meta, self.info)

    def clone(self) -> Batch:
        return Batch(self.tensors.clone(), {k: list(v) for k, v in self.meta.items()}, dict(self.info))

    # ------------------------------------------------------------------ pickling
    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as plain arrays: CPU tensors become numpy arrays (which pickle protocol 5,
        as Ray uses it, moves as out-of-band buffers without a copy); the tensordict's own
        pickling goes through ``torch.save`` per tensor, several times slower for the small
        batches the trainer sends to its ranks every step."""
        tensors = dict(self.tensors.items())
        if not plain_cpu(tensors):
            return (Batch, (self.tensors, self.meta, self.info))
        return (_rebuild_batch, (tensors_to_arrays(tensors), self.meta, self.info, len(self)))


def _rebuild_batch(
    arrays: dict[str, tuple[Any, str]], meta: dict[str, list[Any]], info: dict[str, Any], size: int
) -> Batch:
    return Batch(arrays_to_tensors(arrays), meta, info, batch_size=size)
