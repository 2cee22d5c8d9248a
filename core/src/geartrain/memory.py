"""Measuring memory around phase switches (offload/onload, release/resume)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import psutil
import torch

from geartrain.types import MemoryStats


def current_memory_bytes(device: str = "cpu") -> int:
    """Allocated accelerator memory on GPU; the process's resident set size on CPU."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.memory_allocated())
    return int(psutil.Process().memory_info().rss)


def collect_garbage(device: str = "cpu") -> None:
    """Drop unreachable tensors and return cached blocks to the allocator/OS."""
    gc.collect()
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()


def tensor_bytes(tensors) -> int:  # noqa: ANN001 - any iterable of tensors
    return sum(t.numel() * t.element_size() for t in tensors)


def device_memory_in_use(device: str, cpu: Callable[[], int]) -> int:
    """Memory in use on ``device`` as the driver sees it on GPU (total minus free: inference
    engines such as vLLM's sleep mode or SGLang's memory saver allocate outside PyTorch's
    caching allocator, so ``memory_allocated`` would miss it); ``cpu()`` elsewhere (the
    caller knows which processes hold its memory)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return int(total - free)
    return cpu()


def measured_move(measure: Callable[[], int], move: Callable[[], dict[str, int] | None], *, done: bool) -> MemoryStats:
    """A rollout's ``release``/``resume`` (or an engine's offload/onload) measured: ``move``
    runs between two readings of ``measure`` and may return a break-down by what moved
    (:attr:`MemoryStats.detail`). When ``done`` (already in the target state) nothing runs
    and the stats say so: ``before == after``, 0 seconds."""
    start = time.perf_counter()
    before = measure()
    if done:
        return MemoryStats(before=before, after=before, seconds=0.0)
    detail = move() or {}
    return MemoryStats(before=before, after=measure(), seconds=time.perf_counter() - start, detail=detail)
