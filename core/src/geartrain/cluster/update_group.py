"""The weight-update collective between a trainer and rollout replicas in other processes.

Trainer and replicas each have a ``torch.distributed`` world of their own (their worker
groups), so the broadcast runs over a process group built apart from both: a TCP store
hosted by the sender (member 0) and a gloo (CPU) or NCCL (GPU) backend over it, the way
verl and OpenRLHF build their weight-update groups.

A broadcast is a sequence of buckets (:func:`geartrain.weights.bucketed`), each sent as a
header and one flat byte buffer holding the bucket's tensors back to back; a header with no
tensors ends it. A receiver turns the buckets back into a ``(name, tensor)`` stream for a
rollout's ``update_weights``: one bucket is held at a time, on either side.

The header is JSON, ``{"bytes": <the buffer's size>, "tensors": [[name, shape, dtype], ...]}``,
never a pickle (the group rendezvouses over TCP: bytes from it are data, not code), and a
receiver checks it before it allocates or views anything: a known dtype
(:data:`DTYPES`), a shape of non-negative ints, sizes adding up to ``bytes``. A bad one is
an :class:`UpdateGroupError`, one line naming the sender's rank.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch

from geartrain.cluster.ports import free_port
from geartrain.errors import GeartrainError
from geartrain.weights import BucketStats, bucketed


def free_address() -> tuple[str, int]:
    """This host's address and a free TCP port on it (for the group's store)."""
    port = free_port()
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


_DTYPE_NAMES = (
    "float64 float32 float16 bfloat16 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz "
    "int64 int32 int16 int8 uint8 uint16 uint32 uint64 bool"
).split()
#: the dtypes a bucket may hold, by the name ``str(dtype)`` gives without ``torch.``
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _DTYPE_NAMES if isinstance(getattr(torch, name, None), torch.dtype)
}

#: the largest header a receiver reads (a few hundred bytes per tensor: far above any bucket's)
MAX_HEADER_BYTES = 64 << 20

Header = list[tuple[str, tuple[int, ...], str]]
"""A bucket's tensors: ``(name, shape, dtype name)`` each, in the buffer's order."""


class UpdateGroupError(GeartrainError):
    """A weight-update group received something that is not a valid bucket (one line,
    naming the sender's rank)."""


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * DTYPES[dtype].itemsize


def encode_header(header: Header) -> bytes:
    """``header`` as the JSON bytes a receiver checks (:func:`decode_header`), with the size
    of the bucket's buffer it announces."""
    total = sum(_aligned(_nbytes(shape, dtype)) for _, shape, dtype in header)
    tensors = [[name, list(shape), dtype] for name, shape, dtype in header]
    return json.dumps({"bytes": total, "tensors": tensors}).encode()


def decode_header(raw: bytes, sender: int) -> tuple[Header, int]:
    """The header and buffer size in ``raw`` (from member ``sender``), checked: JSON of the
    form :func:`encode_header` writes, known dtypes, non-negative shapes, sizes adding up
    to the buffer. Raises :class:`UpdateGroupError` (one line) otherwise."""

    def bad(why: str) -> UpdateGroupError:
        return UpdateGroupError(f"weight update: invalid bucket header from rank {sender} (the sender): {why}")

    try:
        payload = json.loads(raw.decode())
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise bad(f"not JSON ({str(exc).splitlines()[0][:200]})") from None
    if not isinstance(payload, dict) or set(payload) != {"bytes", "tensors"}:
        raise bad('not an object with exactly "bytes" and "tensors"')
    total, tensors = payload["bytes"], payload["tensors"]
    if not _is_int(total) or not 0 <= total < 1 << 63:
        raise bad(f'"bytes" is {_short(total)}, not a non-negative int64')
    if not isinstance(tensors, list):
        raise bad('"tensors" is not a list')
    header: Header = []
    for i, entry in enumerate(tensors):
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
            raise bad(f"tensor {i} is {_short(entry)}, not [name, shape, dtype]")
        name, shape, dtype = entry
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise bad(f"tensor {i} ({name[:100]!r}) has unknown dtype {_short(dtype)}")
        if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d < 1 << 63 for d in shape):
            raise bad(f"tensor {i} ({name[:100]!r}) has shape {_short(shape)}, not a list of non-negative int64s")
        header.append((name, tuple(shape), dtype))
    need = sum(_aligned(_nbytes(shape, dtype)) for _, shape, dtype in header)
    if need != total:
        raise bad(f"its {len(header)} tensors take {need} bytes, the bucket says {total}")
    return header, total


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


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

    def _send_header(self, raw: bytes) -> None:
        """Member 0: broadcast a header's bytes (its length first)."""
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device)
        self._broadcast(torch.tensor([data.numel()], dtype=torch.int64, device=self.device))
        self._broadcast(data)

    def _receive_header(self) -> tuple[Header, int]:
        """Members 1..: the next header from member 0 and its buffer size, checked."""
        size = int(self._broadcast(torch.zeros(1, dtype=torch.int64, device=self.device)).item())
        if not 0 < size <= MAX_HEADER_BYTES:
            raise UpdateGroupError(
                f"weight update: invalid bucket header from rank 0 (the sender): it announces {size} bytes "
                f"(a header has 1 to {MAX_HEADER_BYTES})"
            )
        data = self._broadcast(torch.empty(size, dtype=torch.uint8, device=self.device))
        return decode_header(data.cpu().numpy().tobytes(), sender=0)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> BucketStats:
        """Member 0: broadcast ``named_tensors`` in buckets of at most ``bucket_bytes``."""
        assert self.rank == 0, "only member 0 sends"
        stats = BucketStats()
        for bucket in bucketed(named_tensors, bucket_bytes):
            header = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in bucket]
            self._send_header(encode_header(header))
            flat = torch.cat([_padded_bytes(t) for _, t in bucket]).to(self.device)
            self._broadcast(flat)
            stats.num_buckets += 1
            stats.num_tensors += len(bucket)
            stats.bytes += flat.numel()
            stats.max_bucket_bytes = max(stats.max_bucket_bytes, flat.numel())
        self._send_header(encode_header([]))
        return stats

    def receive(self, stats: BucketStats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Members 1..: the broadcast's ``(name, tensor)`` stream, bucket by bucket (it
        must be consumed to its end: the sender waits on every bucket). A header that is
        not a valid bucket raises :class:`UpdateGroupError` before anything is received into
        or viewed from a buffer."""
        assert self.rank != 0, "member 0 sends"
        while True:
            header, total = self._receive_header()
            if not header:
                return
            sizes = [_nbytes(shape, dtype) for _, shape, dtype in header]
            try:
                buffer = torch.empty(total, dtype=torch.uint8, device=self.device)
            except RuntimeError as exc:  # a bucket no process could hold
                raise UpdateGroupError(
                    f"weight update: rank 0 (the sender) announced a bucket of {total} bytes, which cannot be "
                    f"allocated here ({str(exc).splitlines()[0][:200]})"
                ) from None
            flat = self._broadcast(buffer)
            if stats is not None:
                stats.num_buckets += 1
                stats.num_tensors += len(header)
                stats.bytes += flat.numel()
                stats.max_bucket_bytes = max(stats.max_bucket_bytes, flat.numel())
            offset = 0
            for (name, shape, dtype), nbytes in zip(header, sizes, strict=True):
                yield name, flat[offset : offset + nbytes].view(DTYPES[dtype]).view(shape)
                offset += _aligned(nbytes)

    def close(self) -> None:
        self.group = None
        self.store = None
