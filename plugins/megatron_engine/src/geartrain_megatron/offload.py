"""Offload / onload of parameters, gradients and optimizer state between training phases.

Everything is released by *storage*, not by swapping tensors: ``untyped_storage().resize_(0)``
frees a tensor's memory while every view of it stays a valid object (megatron's DDP keeps
``param.main_grad`` as views of its contiguous gradient buffer, the distributed optimizer
keeps views of the parameter buffer, the optimizer keeps the ``Parameter`` objects), and
``resize_`` back plus a copy restores the same storage, so nothing holding a reference
notices. This is the mechanism megatron-core's own ``offload_grad_buffers`` uses.

* ``grads``: megatron's contiguous gradient buffers (``DistributedDataParallel.buffers``).
  Between steps they are all zero (``optimizer_step`` zeroes them), then the storage is
  simply freed and re-created as zeros; a buffer that holds gradients (offload between
  ``forward_backward`` and ``optimizer_step``) is copied to host memory first.
* ``params``: the parameter buffer (distributed optimizer) or each parameter's storage.
* ``optimizer``: every tensor of the optimizer state (Adam's moments; with the distributed
  optimizer the shards this rank owns).

On a GPU, ``params`` and ``optimizer`` are copied to (pinned) host memory and the device
memory is freed: ``MemoryStats`` reports ``torch.cuda.memory_allocated`` before/after. On a
CPU-only machine host memory is the only memory: freeing the gradient buffer really returns
its bytes (the stats report the process's resident set), while ``params`` and ``optimizer``
take the same copy-and-release path as on a GPU and so release nothing net (their copy is
host memory too); the path is kept identical so the CPU tests prove the GPU's restore.
``detail`` reports exact byte counts: ``released_bytes`` (storage freed) and
``host_copy_bytes`` (copies kept), per kind.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from geartrain.memory import collect_garbage, current_memory_bytes
from geartrain.types import MemoryStats

if TYPE_CHECKING:
    from geartrain_megatron.engine import MegatronModel


@dataclass(slots=True)
class Parked:
    """One released storage: the tensor (whose storage is now empty), its size and, unless
    it was all zeros, the host copy to restore from."""

    tensor: torch.Tensor
    nbytes: int
    copy: torch.Tensor | None


def _release(tensor: torch.Tensor, *, zeros_need_no_copy: bool) -> Parked | None:
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes == 0:
        return None
    copy = None
    if not (zeros_need_no_copy and not bool(tensor.any())):
        pin = tensor.device.type == "cuda"
        copy = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
        copy.copy_(tensor)
    storage.resize_(0)
    return Parked(tensor=tensor, nbytes=nbytes, copy=copy)


@torch.no_grad()
def _restore(parked: Parked) -> None:
    parked.tensor.untyped_storage().resize_(parked.nbytes)
    if parked.copy is None:
        parked.tensor.zero_()
    else:
        parked.tensor.copy_(parked.copy)


def _restore_all(parked: list[Parked]) -> int:
    for p in parked:
        _restore(p)
    return sum(p.nbytes for p in parked)


def _ddp_buffers(model: MegatronModel) -> list[Any]:
    return [b for c in model.chunks for b in getattr(c, "buffers", []) + getattr(c, "expert_parallel_buffers", [])]


def _whole_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view of ``tensor``'s entire storage (so the copy covers every byte)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        storage, 0, (storage.nbytes() // tensor.element_size(),)
    )


def _unique(tensors: Iterator[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if t.untyped_storage().nbytes() and ptr not in seen:
            seen.add(ptr)
            out.append(_whole_storage(t))
    return out


def _param_tensors(model: MegatronModel) -> list[torch.Tensor]:
    buffers = [b.param_data for b in _ddp_buffers(model) if getattr(b, "param_data", None) is not None]
    in_buffers = {t.untyped_storage().data_ptr() for t in buffers}
    loose = (p.data for m in model.modules for p in m.parameters())
    return _unique(iter(buffers + [t for t in loose if t.untyped_storage().data_ptr() not in in_buffers]))


def _grad_tensors(model: MegatronModel) -> list[torch.Tensor]:
    return _unique(b.grad_data for b in _ddp_buffers(model) if b.grad_data is not None)


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside megatron's (chained / mixed-precision) optimizer."""
    if optimizer is None:
        return []
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [p.optimizer for p in parts if getattr(p, "optimizer", None) is not None]


def _optimizer_tensors(model: MegatronModel) -> list[torch.Tensor]:
    return _unique(
        v
        for opt in torch_optimizers(model.optimizer)
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


_TENSORS = {"params": _param_tensors, "grads": _grad_tensors, "optimizer": _optimizer_tensors}


def offload(model: MegatronModel, what: frozenset[str]) -> MemoryStats:
    """Release ``what`` (see the module docstring for what that means on GPU and CPU)."""
    dev = model.device.type
    start = time.perf_counter()
    collect_garbage(dev)
    before = current_memory_bytes(dev)
    detail: dict[str, int] = {}
    for kind in sorted(set(what) - model.offloaded):
        parked = [p for t in _TENSORS[kind](model) if (p := _release(t, zeros_need_no_copy=kind == "grads"))]
        model.parked[kind] = parked
        detail[f"{kind}_released_bytes"] = sum(p.nbytes for p in parked)
        detail[f"{kind}_host_copy_bytes"] = sum(
            p.copy.numel() * p.copy.element_size() for p in parked if p.copy is not None
        )
    model.offloaded = model.offloaded | frozenset(what)
    collect_garbage(dev)
    after = current_memory_bytes(dev)
    return MemoryStats(before=before, after=after, seconds=time.perf_counter() - start, detail=detail)


def onload(model: MegatronModel) -> MemoryStats:
    """Re-create every storage :func:`offload` released, bitwise as it was."""
    dev = model.device.type
    start = time.perf_counter()
    before = current_memory_bytes(dev)
    detail: dict[str, int] = {}
    for kind in list(model.parked):
        # popped and restored in a helper, so the host copies are gone before measuring
        detail[f"{kind}_restored_bytes"] = _restore_all(model.parked.pop(kind))
    model.offloaded = frozenset()
    collect_garbage(dev)
    after = current_memory_bytes(dev)
    return MemoryStats(before=before, after=after, seconds=time.perf_counter() - start, detail=detail)


def require_onloaded(model: MegatronModel, hook: str) -> None:
    """Raise a clear error for a hook that needs the released storages."""
    if model.offloaded:
        raise RuntimeError(
            f"megatron engine ({model.ctx.role}): {hook} called while {sorted(model.offloaded)} are offloaded; "
            "call onload first"
        )
