"""Tensors pickled as numpy arrays, for the values that cross process boundaries every step
(:class:`~geartrain.batch.Batch`, :class:`~geartrain.types.StepOutput`).

A torch tensor pickles through ``torch.save``'s storage machinery, a cost paid per tensor
that dominates for the small per-token tensors of a step; a numpy array pickles (protocol 5,
as Ray uses it) as one out-of-band buffer. Only plain CPU tensors take this path: a tensor
on a device or one that requires grad keeps torch's own pickling.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

#: numpy has no bfloat16: such tensors travel as their int16 bits
_BITS = {torch.bfloat16: torch.int16}


def plain_cpu(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether every tensor is on the CPU, needs no grad and is a dense strided tensor."""
    return all(t.device.type == "cpu" and not t.requires_grad and t.layout is torch.strided for t in tensors.values())


def tensors_to_arrays(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[Any, str]]:
    """``{name: (numpy array, torch dtype name)}`` for plain CPU tensors (see :func:`plain_cpu`)."""
    out = {}
    for name, tensor in tensors.items():
        bits = _BITS.get(tensor.dtype)
        raw = tensor.contiguous() if bits is None else tensor.contiguous().view(bits)
        out[name] = (raw.numpy(), str(tensor.dtype).removeprefix("torch."))
    return out


def arrays_to_tensors(arrays: Mapping[str, tuple[Any, str]]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`tensors_to_arrays`. Each tensor owns a copy of its array: the
    buffer may be read-only (Ray's object store) and receivers write into what they get."""
    out = {}
    for name, (array, dtype) in arrays.items():
        tensor = torch.from_numpy(array.copy())
        target = getattr(torch, dtype)
        out[name] = tensor.view(target) if tensor.dtype != target else tensor
    return out
