"""One-step (bounded-staleness) off-policy generation: the rollout generates the next
steps' samples on a thread of its own while the actor trains.

A single background thread runs, in submission order, the rollout's generations and the
loads of weight snapshots the actor takes after each update. Because both go through the
same queue, a generation never reads weights while they are being replaced, and the
weights a generation used are known exactly (``version`` = optimizer steps behind them).
torch runs each Python thread's operators on that thread (plus ``torch.set_num_threads``
intra-op workers each), so generation and training proceed on different cores.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from geartrain.batch import Batch
from geartrain.daemon_pool import DaemonThreadPool
from geartrain.types import SamplingParams


class WeightSnapshot:
    """A :class:`geartrain.rollout.WeightReceiver` that keeps copies of what it is given,
    to be loaded into the rollout later (the trainer keeps changing the originals)."""

    def __init__(self, dtype: torch.dtype, bucket_bytes: int) -> None:
        self.dtype = dtype
        self.bucket_bytes = bucket_bytes
        self.tensors: list[tuple[str, torch.Tensor]] = []

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.tensors.extend((name, tensor.detach().clone()) for name, tensor in named_tensors)


@dataclass(kw_only=True, slots=True)
class Generated:
    batch: Batch
    version: int
    """Optimizer steps behind the weights that generated the batch."""
    seconds: float


class GenerationQueue:
    """Generations and weight loads of one rollout, run in order on one thread."""

    def __init__(self, rollout: object, version: int = 0) -> None:
        self.rollout = rollout
        self.version = version  # of the weights in the rollout, as seen by the queue's thread
        # daemon threads, not a ThreadPoolExecutor: the interpreter joins a pool's threads at
        # exit, so a generation that never returns (a hung rollout plugin) held the process
        # after Ctrl-C's closing line until SIGKILL; close() still waits for the work in hand
        self._pool = DaemonThreadPool(1, thread_name_prefix="geartrain-rollout")

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Future[Generated]:
        return self._pool.submit(self._generate, prompts, sampling)

    def load(self, snapshot: WeightSnapshot, version: int) -> Future[None]:
        return self._pool.submit(self._load, snapshot, version)

    def close(self) -> None:
        """Cancel what has not started, wait for the call in progress, end the thread."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Generated:
        start = time.perf_counter()
        batch = self.rollout.generate(prompts, sampling)  # type: ignore[attr-defined]
        return Generated(batch=batch, version=self.version, seconds=time.perf_counter() - start)

    def _load(self, snapshot: WeightSnapshot, version: int) -> None:
        self.rollout.update_weights(snapshot.tensors)  # type: ignore[attr-defined]
        self.version = version
