"""Bucketed weight streaming: what every engine's ``reshard_for_rollout`` and every
rollout's ``update_weights`` need, written once.

The contract (``reshard_for_rollout`` in :mod:`geartrain.hookspecs`): an engine hands the
receiver's ``update_weights`` an *iterator* of ``(transformers name, full tensor in
receiver.dtype)`` that gathers at most ``receiver.bucket_bytes`` at a time, so the extra
memory held at once is one bucket, not the model.

Engine side:

* :func:`send_weights` — the whole hook for most engines: plan, stream, hand over, finish
  the gathers the receiver did not consume, report :class:`~geartrain.types.SyncStats`.
  A single-process engine passes ``module.state_dict(keep_vars=True).items()``; a sharded
  one also passes ``materialize`` (e.g. ``DTensor.full_tensor``, a collective).
* :func:`stream_weights` — the stream alone (for export, or when the caller times it).
* :func:`plan_buckets` / :func:`stream_buckets` — the two halves, for engines whose
  gathers are not per tensor.

Rollout side: :func:`bucketed` cuts an incoming stream into lists of at most
``bucket_bytes`` (one RPC each), lazily; :func:`checked` refuses a name the model does not
have (:class:`UnknownTensorError`) before the engine sees it; :func:`tied_aliases` /
:func:`with_aliases` send a tied weight under each of its names (engines keep a tied output
layer as a layer of its own, or load only one of the names); :class:`WeightCopy` keeps the
last synced weights on the host for an engine that is shut down on release and restarted.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import torch

from geartrain.errors import NonFiniteWeightsError
from geartrain.types import SyncStats, WeightReceiver

K = TypeVar("K")
T = TypeVar("T")

__all__ = [
    "Bucket",
    "BucketStats",
    "UnknownTensorError",
    "WeightCopy",
    "bucketed",
    "checked",
    "deliver_stream",
    "drain",
    "plan_buckets",
    "refuse_non_finite",
    "send_weights",
    "stream_buckets",
    "stream_weights",
    "tied_aliases",
    "tied_groups",
    "with_aliases",
]


@dataclass(kw_only=True, slots=True)
class BucketStats:
    """What a stream moved so far (filled in while it is consumed)."""

    num_tensors: int = 0
    num_buckets: int = 0
    bytes: int = 0
    max_bucket_bytes: int = 0


@dataclass(kw_only=True, slots=True)
class Bucket(Generic[K]):
    """Keys gathered together, and their planned size in bytes."""

    keys: list[K]
    nbytes: int


def _group(items: Iterable[T], size: Callable[[T], int], limit: int) -> Iterator[tuple[list[T], int]]:
    """Consecutive ``items`` in groups whose sizes add up to at most ``limit`` (an item larger
    than that is a group of its own), lazily, order kept."""
    if limit < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {limit}")
    current: list[T] = []
    total = 0
    for item in items:
        nbytes = size(item)
        if current and total + nbytes > limit:
            yield current, total
            current, total = [], 0
        current.append(item)
        total += nbytes
    if current:
        yield current, total


def plan_buckets(items: Iterable[tuple[K, int]], bucket_bytes: int) -> list[Bucket[K]]:
    """Consecutive ``(key, nbytes)`` items grouped into buckets of at most ``bucket_bytes``
    (a larger item forms a bucket of its own; order kept)."""
    return [Bucket(keys=[k for k, _ in group], nbytes=n) for group, n in _group(items, lambda kv: kv[1], bucket_bytes)]


def tied_groups(
    entries: Iterable[tuple[str, torch.Tensor]], *, apart: Collection[str] = ()
) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    """``entries`` (``(name, tensor)``) as ``(names, tensor)``, one per distinct tensor, in
    the order each first appears: the names of a tensor listed more than once (tied weights,
    e.g. an output layer tied to the input embedding) are kept together. A name in
    ``apart`` stays on its own (a LoRA-adapted weight, whose merged value is not its
    partner's)."""
    groups: dict[object, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in entries:
        key: object = ("apart", name) if name in apart else id(tensor)
        groups.setdefault(key, ([], tensor))[0].append(name)
    return [(tuple(names), tensor) for names, tensor in groups.values()]


def bucketed(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """A ``(name, tensor)`` stream cut into lists of at most ``bucket_bytes`` (a larger
    tensor is a list of its own), consuming the stream only as far as the current list."""
    for group, _ in _group(named_tensors, lambda nt: nt[1].numel() * nt[1].element_size(), bucket_bytes):
        yield group


def stream_buckets(
    buckets: Sequence[Bucket[K]],
    gather: Callable[[list[K]], list[tuple[str, torch.Tensor]]],
    stats: BucketStats | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` bucket by bucket; ``gather(keys)`` materialises one
    bucket (it may be collective: every rank must consume the stream to its end). A
    bucket's tensors are dropped before the next one is gathered.

    Non-finite weights are never published: a bucket holding a NaN or infinite value raises
    :class:`~geartrain.errors.NonFiniteWeightsError` (naming the first such tensor) before
    any of its tensors is yielded. Every rank gathers the same full tensors, so every rank
    raises at the same bucket."""
    for bucket in buckets:
        named = gather(bucket.keys)
        refuse_non_finite(named)
        if stats is not None:
            nbytes = sum(t.numel() * t.element_size() for _, t in {id(t): (n, t) for n, t in named}.values())
            stats.num_buckets += 1
            stats.num_tensors += len(named)
            stats.bytes += nbytes
            stats.max_bucket_bytes = max(stats.max_bucket_bytes, nbytes)
        while named:
            yield named.pop(0)
        del named


def refuse_non_finite(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Raise :class:`~geartrain.errors.NonFiniteWeightsError` for the first floating-point
    tensor of ``named`` holding a NaN or an infinity (one host read for the whole list)."""
    floating = [(name, t) for name, t in named if t.is_floating_point() and t.numel()]
    if not floating:
        return
    finite = torch.stack([torch.isfinite(t).all() for _, t in floating])
    if bool(finite.all()):
        return
    name = floating[int((~finite).nonzero()[0, 0])][0]
    raise NonFiniteWeightsError(
        name,
        f"the policy's weight {name} holds NaN or infinite values, so it was not published (weights are checked "
        "before they reach a rollout or an export)",
    )


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def stream_weights(
    entries: Iterable[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype,
    bucket_bytes: int,
    device: torch.device | str = "cpu",
    materialize: Callable[[torch.Tensor], torch.Tensor] = _identity,
    stats: BucketStats | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full copies of ``entries`` (``(transformers name, tensor)``, e.g. a model's
    ``state_dict(keep_vars=True).items()``), cast to ``dtype`` on ``device``, gathered
    ``bucket_bytes`` at a time (planned at ``dtype``'s size).

    ``materialize(tensor)`` turns a stored tensor into the full one (a collective for
    sharded tensors: then every rank must consume the stream to its end). A tensor listed
    under several names (tied weights) is planned once, with all its names in one bucket:
    materialised and counted once, and yielded under each name (right after one another).
    The yielded tensors never alias the live parameters."""
    groups = tied_groups(entries)
    by_name = {names[0]: tensor for names, tensor in groups}
    itemsize = torch.empty((), dtype=dtype).element_size()
    target = torch.device(device)
    buckets = plan_buckets([(names, t.numel() * itemsize) for names, t in groups], bucket_bytes)

    def gather(keys: list[tuple[str, ...]]) -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        for names in keys:
            live = by_name[names[0]].detach()
            full = materialize(live).to(device=target, dtype=dtype)
            # .to() returns the live tensor itself when nothing changes: hand out a copy
            full = torch.empty_like(full).copy_(full) if full is live else full
            out += [(name, full) for name in names]
        return out

    return stream_buckets(buckets, gather, stats)


def drain(stream: Iterable[object]) -> None:
    """Consume a stream without keeping anything (ranks that receive no weights must
    still take part in the gathers)."""
    for _ in stream:
        pass


def send_weights(
    entries: Iterable[tuple[str, torch.Tensor]],
    receiver: WeightReceiver | None,
    *,
    dtype: torch.dtype | None = None,
    bucket_bytes: int | None = None,
    device: torch.device | str = "cpu",
    materialize: Callable[[torch.Tensor], torch.Tensor] = _identity,
) -> SyncStats:
    """``reshard_for_rollout`` in one call: stream ``entries`` (see :func:`stream_weights`)
    into ``receiver.update_weights``, then finish whatever it did not consume (so the
    gathers complete on every rank), and report what moved.

    ``dtype`` and ``bucket_bytes`` default to the receiver's; ranks without a receiver
    (``receiver=None``) still stream, with the given values (or float32 and 64 MiB), so
    that collective gathers match across ranks. Sharded engines must pass the same
    ``dtype``/``bucket_bytes`` on every rank. ``device`` is where each bucket is gathered,
    cast and handed to the receiver (default ``"cpu"``); an engine on an accelerator passes
    its own device (the FSDP engine passes the model's), so a colocated rollout receives
    tensors there without a host round trip."""
    start = time.perf_counter()
    if dtype is None:
        dtype = receiver.dtype if receiver is not None else torch.float32
    if bucket_bytes is None:
        bucket_bytes = receiver.bucket_bytes if receiver is not None else 64 << 20
    stats = BucketStats()
    stream = stream_weights(
        entries, dtype=dtype, bucket_bytes=bucket_bytes, device=device, materialize=materialize, stats=stats
    )
    return deliver_stream(stream, receiver, stats, start=start)


def deliver_stream(
    stream: Iterator[tuple[str, torch.Tensor]], receiver: WeightReceiver | None, stats: BucketStats, *, start: float
) -> SyncStats:
    """Hand ``stream`` to ``receiver.update_weights`` (when there is a receiver), finish
    whatever it did not consume (so the gathers complete on every rank), and report what
    ``stats`` counted and the time since ``start`` (a ``time.perf_counter()`` reading)."""
    if receiver is not None:
        receiver.update_weights(stream)
    drain(stream)
    return SyncStats(
        seconds=time.perf_counter() - start,
        bytes=stats.bytes,
        num_tensors=stats.num_tensors,
        num_buckets=stats.num_buckets,
        max_bucket_bytes=stats.max_bucket_bytes,
    )


# --------------------------------------------------------------------------- receiving side


class UnknownTensorError(KeyError):
    """A weight stream named a tensor the model does not have (``name``)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def checked(
    named_tensors: Iterable[tuple[str, torch.Tensor]], known: frozenset[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass the stream through, raising :class:`UnknownTensorError` at the first name not in
    ``known`` (e.g. the transformers state dict's names), before it reaches an engine."""
    for name, tensor in named_tensors:
        if name not in known:
            raise UnknownTensorError(name)
        yield name, tensor


def tied_aliases(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """For each parameter name of ``model`` (a meta-device skeleton is enough), the other
    names of the same tensor (tied embeddings); untied names are absent."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return {
        name: tuple(other for other in names if other != name)
        for names in groups.values()
        if len(names) > 1
        for name in names
    }


def with_aliases(
    named_tensors: Iterable[tuple[str, torch.Tensor]], aliases: dict[str, tuple[str, ...]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield each tensor under every name it is tied to, each name once: a sync naming only
    one of them (``lm_head.weight`` or the input embedding) reaches both."""
    sent: set[str] = set()
    for name, tensor in named_tensors:
        for alias in (name, *aliases.get(name, ())):
            if alias not in sent:
                sent.add(alias)
                yield alias, tensor


class WeightCopy:
    """A host copy of the last synced weights (name -> CPU tensor) for a rollout whose
    ``release`` shuts its engine down (no sleep mode on CPU) and whose ``resume`` restarts it
    and loads them. Merged across syncs (a sync naming some tensors updates only those),
    optionally spilled to one safetensors file while the engine is released; names keep the
    order they first arrived in."""

    def __init__(self, spill_path: str | Path) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self._names: list[str] = []
        self._spill_path = Path(spill_path)
        self._spilled = False

    def __len__(self) -> int:
        return len(self._names)

    @property
    def spilled(self) -> bool:
        """Whether the tensors are on disk (``spill``) rather than in memory."""
        return self._spilled

    @property
    def nbytes(self) -> int:
        """Bytes held in memory (0 while spilled)."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def tee(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass the stream through, keeping a CPU copy of each tensor (a spilled copy is
        read back first, so the sync merges into it)."""
        self.restore()
        for name, tensor in named_tensors:
            held = self._tensors.get(name)
            if held is not None and held.shape == tensor.shape and held.dtype == tensor.dtype:
                held.copy_(tensor.detach())  # reuse the buffer: no new allocation per sync
            else:
                if held is None:
                    self._names.append(name)
                self._tensors[name] = tensor.detach().to("cpu", copy=True)
            yield name, tensor

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The held tensors in arrival order (read back one at a time while spilled)."""
        if not self._spilled:
            for name in list(self._names):
                yield name, self._tensors[name]
            return
        from safetensors import safe_open

        with safe_open(str(self._spill_path), framework="pt") as f:
            for name in self._names:
                yield name, f.get_tensor(name)

    def released(self, spill: bool) -> dict[str, int]:
        """The engine it backs was shut down (``release``): spill the copy to disk when
        ``spill``; returns the ``MemoryStats.detail`` entry (``weight_copy_bytes``: what the
        copy held in memory before)."""
        detail = {"weight_copy_bytes": self.nbytes}
        if spill:
            self.spill()
        return detail

    def spill(self) -> None:
        """Write the held tensors to disk and drop them from memory."""
        if self._spilled or not self._tensors:
            return
        from safetensors.torch import save_file

        self._spill_path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self._tensors.items()}, str(self._spill_path))
        self._tensors = {}
        self._spilled = True
        gc.collect()

    def restore(self) -> None:
        """Bring spilled tensors back into memory and remove the file."""
        if not self._spilled:
            return
        from safetensors.torch import load_file

        self._tensors = load_file(str(self._spill_path))
        self._spilled = False
        self._spill_path.unlink(missing_ok=True)

    def clear(self) -> None:
        """Drop everything, the spill file included."""
        self._tensors = {}
        self._names = []
        self._spilled = False
        self._spill_path.unlink(missing_ok=True)
