"""Moving parameters, gradients and optimizer state off the accelerator and back.

On a GPU the tensors go to host memory and come back to the device. On a CPU-only
machine they already live in host memory: there is nothing to move, and the hooks
measure (resident set before/after) without copying. With ``options.cpu_offload`` FSDP2
keeps the sharded state in host memory all the time (``CPUOffloadPolicy``).
"""

from __future__ import annotations

import time

import torch
from geartrain.memory import collect_garbage, current_memory_bytes, tensor_bytes
from geartrain.types import MemoryStats

from geartrain_fsdp.sharding import FSDPModel


def _move_module(model: FSDPModel, device: torch.device) -> None:
    # FSDP2 re-registers its sharded parameters when the module is moved as a whole
    model.module.to(device)


def _move_grads(model: FSDPModel, device: torch.device) -> None:
    for p in model.module.parameters():
        if p.grad is not None:
            p.grad = p.grad.to(device)


def _move_optimizer(model: FSDPModel, device: torch.device) -> None:
    if model.optimizer is None:
        return
    for state in model.optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device)


def _sizes(model: FSDPModel) -> dict[str, int]:
    params = [p.to_local() if hasattr(p, "to_local") else p for p in model.module.parameters()]
    grads = [
        g.to_local() if hasattr(g, "to_local") else g for p in model.module.parameters() if (g := p.grad) is not None
    ]
    optim = []
    if model.optimizer is not None:
        for state in model.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    optim.append(value.to_local() if hasattr(value, "to_local") else value)
    return {
        "params_bytes": tensor_bytes(params),
        "grads_bytes": tensor_bytes(grads),
        "optimizer_bytes": tensor_bytes(optim),
    }


def _moves(model: FSDPModel) -> bool:
    return model.device.type != "cpu" and not model.options.cpu_offload


def offload(model: FSDPModel, what: frozenset[str]) -> MemoryStats:
    """Move ``what`` to host memory (see the module docstring for CPU machines)."""
    dev = model.device.type
    start = time.perf_counter()
    collect_garbage(dev)
    before = current_memory_bytes(dev)
    if _moves(model):
        cpu = torch.device("cpu")
        if "params" in what:
            _move_module(model, cpu)
        if "grads" in what:
            _move_grads(model, cpu)
        if "optimizer" in what:
            _move_optimizer(model, cpu)
    model.offloaded = model.offloaded | frozenset(what)
    collect_garbage(dev)
    after = current_memory_bytes(dev)
    return MemoryStats(before=before, after=after, seconds=time.perf_counter() - start, detail=_sizes(model))


def onload(model: FSDPModel) -> MemoryStats:
    """Bring back what :func:`offload` moved."""
    dev = model.device.type
    start = time.perf_counter()
    before = current_memory_bytes(dev)
    if _moves(model):
        if "params" in model.offloaded:
            _move_module(model, model.device)
        if "grads" in model.offloaded:
            _move_grads(model, model.device)
        if "optimizer" in model.offloaded:
            _move_optimizer(model, model.device)
    model.offloaded = frozenset()
    after = current_memory_bytes(dev)
    return MemoryStats(before=before, after=after, seconds=time.perf_counter() - start, detail=_sizes(model))
