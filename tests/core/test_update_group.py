"""The weight-update broadcast (trainer -> rollout replicas) over gloo: members in threads
of this process, each with the group's own store and backend, as the Ray ranks have."""

from __future__ import annotations

import socket
import threading

import torch
from geartrain.cluster.update_group import UpdateGroup
from geartrain.weights import BucketStats


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(11, 8, generator=g)),
        ("model.norm.weight", torch.randn(3, generator=g).bfloat16()),  # 6 bytes: the next one must realign
        ("lm_head.weight", torch.randn(5, 8, generator=g, dtype=torch.float64)),
        ("counts", torch.arange(7, dtype=torch.int8)),
    ]


def test_broadcast_reaches_every_replica_bitwise_in_buckets() -> None:
    port, size = _port(), 3
    sent = _weights()
    received: dict[tuple[int, int], list[tuple[str, torch.Tensor]]] = {}
    stats: dict[tuple[int, int], BucketStats] = {}
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            group = UpdateGroup("127.0.0.1", port, rank, size, timeout_s=60)
            for bucket_bytes in (400, 10_000):  # two broadcasts: in two buckets, then in one
                if rank == 0:
                    stats[rank, bucket_bytes] = group.send(iter(sent), bucket_bytes=bucket_bytes)
                else:
                    stats[rank, bucket_bytes] = BucketStats()
                    received[rank, bucket_bytes] = [(n, t.clone()) for n, t in group.receive(stats[rank, bucket_bytes])]
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for key in received:
        assert [n for n, _ in received[key]] == [n for n, _ in sent]
        for (_, got), (name, want) in zip(received[key], sent, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(got, want), name
        assert stats[key] == stats[0, key[1]]
    # 352 + 6 | 320 + 7 bytes in buckets of at most 400, then all in one; each tensor is
    # padded to 16 bytes so that the float64 after the 6-byte bf16 one can be viewed in place
    assert [stats[0, b].num_buckets for b in (400, 10_000)] == [2, 1]
    assert stats[0, 10_000].bytes == 352 + 16 + 320 + 16
