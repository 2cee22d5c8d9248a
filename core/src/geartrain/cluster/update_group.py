"""The weight-update collective between a trainer and rollout replicas in other processes.

Trainer and replicas each have a ``torch.distributed`` world of their own (their worker
groups), so the broadcast runs over a process group built apart from both: a TCP store
hosted by the sender (member 0) and a gloo (CPU) or NCCL (GPU) backend over it, the way
verl and OpenRLHF build their weight-update groups.

A broadcast is a sequence of buckets (:func:`geartrain.weights.bucketed`), each sent as a
header (names, shapes, dtypes; a pickled byte tensor) and one flat byte buffer holding the
bucket's tensors back to back; an empty header ends it. A receiver turns the buckets back
into a ``(name, tensor)`` stream for a rollout's ``update_weights``: one bucket is held at
a time, on either side.
"""

from __future__ import annotations

import pickle
import socket
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch

from geartrain.weights import BucketStats, bucketed


def free_address() -> tuple[str, int]:
    """This host's address and a free TCP port on it (for the group's store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    try:
        import ray

        host = ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - not in a Ray worker
        host = "127.0.0.1"
    return host, port


#: each tensor starts at a multiple of this many bytes in a bucket's buffer (a view as its dtype needs it)
ALIGN = 16


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _padded_bytes(tensor: torch.Tensor) -> torch.Tensor:
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = _aligned(raw.numel()) - raw.numel()
    return torch.cat([raw, raw.new_zeros(pad)]) if pad else raw


class UpdateGroup:
    """Member ``rank`` of a ``size``-member broadcast group rendezvousing at
    ``address:port`` (member 0 hosts the store and is the sender). Every member must
    construct it at the same time: the constructor returns once all have joined."""

    def __init__(
        self, address: str, port: int, rank: int, size: int, *, device: str = "cpu", timeout_s: float = 300.0
    ) -> None:
        from torch.distributed import PrefixStore, TCPStore

        self.rank, self.size, self.device = rank, size, torch.device(device)
        timeout = timedelta(seconds=timeout_s)
        self.store = TCPStore(address, port, size, rank == 0, timeout=timeout)
        prefixed = PrefixStore("geartrain-weights", self.store)
        if self.device.type == "cuda":
            from torch.distributed import ProcessGroupNCCL

            self.group: Any = ProcessGroupNCCL(prefixed, rank, size)
        else:
            from torch.distributed import ProcessGroupGloo

            self.group = ProcessGroupGloo(prefixed, rank, size, timeout)

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        self.group.broadcast(tensor, 0).wait()
        return tensor

    def _header(self, header: list[tuple[str, tuple[int, ...], str]] | None) -> list[tuple[str, tuple[int, ...], str]]:
        """Member 0 broadcasts ``header``; the others receive and return it."""
        if header is not None:
            data = torch.frombuffer(bytearray(pickle.dumps(header)), dtype=torch.uint8).to(self.device)
            self._broadcast(torch.tensor([data.numel()], dtype=torch.int64, device=self.device))
            self._broadcast(data)
            return header
        size = self._broadcast(torch.zeros(1, dtype=torch.int64, device=self.device))
        data = self._broadcast(torch.empty(int(size.item()), dtype=torch.uint8, device=self.device))
        # a header comes from member 0 of this job's own group, never from outside
        return pickle.loads(data.cpu().numpy().tobytes())  # noqa: S301

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> BucketStats:
        """Member 0: broadcast ``named_tensors`` in buckets of at most ``bucket_bytes``."""
        assert self.rank == 0, "only member 0 sends"
        stats = BucketStats()
        for bucket in bucketed(named_tensors, bucket_bytes):
            header = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in bucket]
            self._header(header)
            flat = torch.cat([_padded_bytes(t) for _, t in bucket]).to(self.device)
            self._broadcast(flat)
            stats.num_buckets += 1
            stats.num_tensors += len(bucket)
            stats.bytes += flat.numel()
            stats.max_bucket_bytes = max(stats.max_bucket_bytes, flat.numel())
        self._header([])
        return stats

    def receive(self, stats: BucketStats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Members 1..: the broadcast's ``(name, tensor)`` stream, bucket by bucket (it
        must be consumed to its end: the sender waits on every bucket)."""
        assert self.rank != 0, "member 0 sends"
        while True:
            header = self._header(None)
            if not header:
                return
            sizes = [_nbytes(shape, dtype) for _, shape, dtype in header]
            flat = self._broadcast(torch.empty(sum(_aligned(n) for n in sizes), dtype=torch.uint8, device=self.device))
            if stats is not None:
                stats.num_buckets += 1
                stats.num_tensors += len(header)
                stats.bytes += flat.numel()
                stats.max_bucket_bytes = max(stats.max_bucket_bytes, flat.numel())
            offset = 0
            for (name, shape, dtype), nbytes in zip(header, sizes, strict=True):
                yield name, flat[offset : offset + nbytes].view(getattr(torch, dtype)).view(shape)
                offset += _aligned(nbytes)

    def close(self) -> None:
        self.group = None
        self.store = None
