"""Size-bounded bucketing of named tensors for weight synchronisation and export.

An engine knows each tensor's name and size before it gathers it. :func:`plan_buckets`
groups them into buckets of at most ``bucket_bytes`` (a tensor larger than that forms a
bucket of its own); :func:`stream_buckets` then gathers one bucket at a time through the
engine's ``gather`` callback and yields its tensors, dropping them before the next bucket
is gathered, so the extra memory held at once is bounded by one bucket (plus whatever
the consumer keeps).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

K = TypeVar("K")


@dataclass(kw_only=True, slots=True)
class BucketStats:
    """What a stream moved so far (filled in while it is consumed)."""

    num_tensors: int = 0
    num_buckets: int = 0
    bytes: int = 0
    max_bucket_bytes: int = 0


@dataclass(kw_only=True, slots=True)
class Bucket(Generic[K]):
    keys: list[K]
    nbytes: int


def plan_buckets(items: Iterable[tuple[K, int]], bucket_bytes: int) -> list[Bucket[K]]:
    """Consecutive ``(key, nbytes)`` items grouped into buckets of at most ``bucket_bytes``
    (order kept)."""
    if bucket_bytes < 1:
        raise ValueError("bucket_bytes must be >= 1")
    buckets: list[Bucket[K]] = []
    current: list[K] = []
    size = 0
    for key, nbytes in items:
        if current and size + nbytes > bucket_bytes:
            buckets.append(Bucket(keys=current, nbytes=size))
            current, size = [], 0
        current.append(key)
        size += nbytes
    if current:
        buckets.append(Bucket(keys=current, nbytes=size))
    return buckets


def stream_buckets(
    buckets: Sequence[Bucket[K]],
    gather: Callable[[list[K]], list[tuple[str, torch.Tensor]]],
    stats: BucketStats | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` bucket by bucket; ``gather(keys)`` materialises one
    bucket (it may be collective: every rank must consume the stream to its end)."""
    for bucket in buckets:
        named = gather(bucket.keys)
        if stats is not None:
            nbytes = sum(t.numel() * t.element_size() for _, t in {id(t): (n, t) for n, t in named}.values())
            stats.num_buckets += 1
            stats.num_tensors += len(named)
            stats.bytes += nbytes
            stats.max_bucket_bytes = max(stats.max_bucket_bytes, nbytes)
        while named:
            yield named.pop(0)
        del named


def drain(stream: Iterable[object]) -> None:
    """Consume a stream without keeping anything (ranks that receive no weights must
    still take part in the gathers)."""
    for _ in stream:
        pass
