"""The weight-update broadcast (trainer -> rollout replicas) over gloo: members in threads
of this process, each with the group's own store and backend, as the Ray ranks have."""

from __future__ import annotations

import json
import pickle
import re
import socket
import threading
from pathlib import Path

import pytest
import torch
from geartrain.cluster.update_group import UpdateGroup, UpdateGroupError, encode_header
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
        t.join()  # a hang guard without a clock of its own: every wait of a member ends by the group's timeout_s
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


class _Touch:
    """A pickle that creates ``path`` when it is loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.path,))


def _forged(kind: str, marker: Path) -> tuple[bytes, str]:
    """A header from a sender that is not geartrain's (its bytes), and what the error says."""
    good = json.loads(encode_header([("w", (2, 4), "float32"), ("b", (3,), "bfloat16")]))  # 32 + 16 bytes
    if kind == "pickle":
        return pickle.dumps(_Touch(marker)), r"not JSON"
    if kind == "unknown dtype":
        good["tensors"][1][2] = "Evil"
        return json.dumps(good).encode(), r"tensor 1 \('b'\) has unknown dtype \"Evil\""
    if kind == "negative shape":  # -2 x 4 float32 and 4 x 4 float32 "add up" to a 32-byte bucket
        good["tensors"] = [["w", [-2, 4], "float32"], ["v", [4, 4], "float32"]]
        good["bytes"] = 32
        return json.dumps(good).encode(), r"tensor 0 \('w'\) has shape \[-2, 4\], not a list of non-negative"
    assert kind == "size not the bucket's"  # the buffer would end 16 bytes after the tensors
    good["bytes"] += 16
    return json.dumps(good).encode(), r"its 2 tensors take 48 bytes, the bucket says 64"


@pytest.mark.parametrize("kind", ["pickle", "unknown dtype", "negative shape", "size not the bucket's"])
def test_a_forged_header_is_one_line_naming_the_sender_never_a_crash_or_a_tensor(kind: str, tmp_path: Path) -> None:
    """A real 2-member group whose member 0 sends a header geartrain's sender never writes
    (then, should the receiver accept it, the buffer it announces): the receiver raises
    UpdateGroupError, one line naming rank 0, yields nothing and runs nothing."""
    port, marker = _port(), tmp_path / "unpickled"
    raw, says = _forged(kind, marker)
    got: list[tuple[str, torch.Tensor]] = []
    outcome: list[BaseException] = []

    def receiver() -> None:
        group = UpdateGroup("127.0.0.1", port, 1, 2, timeout_s=60)
        try:
            got.extend(group.receive())
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)
        finally:
            group.close()  # the sender's pending broadcast (if any) ends with the connection

    thread = threading.Thread(target=receiver)
    thread.start()
    sender = UpdateGroup("127.0.0.1", port, 0, 2, timeout_s=60)
    try:
        sender._send_header(raw)
        announced = json.loads(raw).get("bytes") if raw.startswith(b"{") else None
        if isinstance(announced, int):  # what a receiver that accepted the header waits for
            sender._broadcast(torch.arange(announced, dtype=torch.uint8))
            sender._send_header(encode_header([]))
    except RuntimeError:
        pass  # the receiver refused it and left the group
    finally:
        thread.join()  # a hang guard without a clock of its own: the group's timeout_s ends every wait
        sender.close()
    assert got == [] and not marker.exists()
    assert len(outcome) == 1 and isinstance(outcome[0], UpdateGroupError), outcome
    message = str(outcome[0])
    assert "\n" not in message and "from rank 0 (the sender)" in message, message
    assert re.search(says, message), message
