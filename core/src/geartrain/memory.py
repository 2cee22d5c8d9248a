"""Measuring memory around phase switches (offload/onload, release/resume)."""

from __future__ import annotations

import gc

import psutil
import torch


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
