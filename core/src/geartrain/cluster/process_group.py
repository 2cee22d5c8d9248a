"""The process group of a one-rank role (the ``inline`` placement).

Every engine gets a process group in :attr:`geartrain.types.EngineContext.process_group`,
also on one rank, so a backend that needs one (DDP, anything with collectives) never builds
its own. On one rank it is a group of size 1 (gloo on CPU, NCCL on GPU) made only with
public ``torch.distributed`` calls:

* if nobody initialised ``torch.distributed`` in this process, the default group is
  initialised with one rank over an in-memory :class:`torch.distributed.HashStore`;
* the role's group is then ``new_group([this rank])``.

Groups are shared and reference counted per backend: every :func:`acquire_single_rank_group`
is matched by one :func:`release_single_rank_group`; the last release destroys the group, and
the default group too when this module initialised it.

:func:`with_process_group` is how the core keeps the promise for contexts built by hand
(``EngineContext(role="actor")``, as in docs/guide.md): :class:`geartrain.Engine` and
:class:`geartrain.Rollout` supply the size-1 group whenever none is given.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from typing import Any

from geartrain.errors import GeartrainError
from geartrain.types import EngineContext

_lock = threading.Lock()
_groups: dict[str, list[Any]] = {}  # backend -> [group, users]
_owns_default = False


def backend_for(device: str) -> str:
    """``nccl`` for ``cuda``, ``gloo`` otherwise."""
    return "nccl" if device == "cuda" else "gloo"


def acquire_single_rank_group(device: str = "cpu") -> Any:
    """A process group holding only this process's rank, for a role on ``device``.
    Release it with :func:`release_single_rank_group` when the role shuts down."""
    global _owns_default
    import torch.distributed as dist

    backend = backend_for(device)
    with _lock:
        if not dist.is_initialized():
            hook = sys.excepthook
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            if getattr(hook, "__name__", "") == "_distributed_excepthook":
                # torch wraps the hook at every init ("[rank0]: " per line): once is enough
                sys.excepthook = hook
            _owns_default = True
        entry = _groups.get(backend)
        if entry is None:
            if dist.get_world_size() == 1:
                group = dist.new_group([0], backend=backend)
            else:  # a rank of a larger world (e.g. a Ray worker) running a one-rank role
                group = dist.new_group([dist.get_rank()], backend=backend, use_local_synchronization=True)
            entry = _groups[backend] = [group, 0]
        entry[1] += 1
        return entry[0]


def release_single_rank_group(group: Any) -> None:
    """Give back one use of ``group``; the last use destroys it (and the default group when
    :func:`acquire_single_rank_group` created that)."""
    global _owns_default
    import torch.distributed as dist

    with _lock:
        backend = next((b for b, (g, _) in _groups.items() if g is group), None)
        if backend is None:
            return
        entry = _groups[backend]
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _groups[backend]
        if not dist.is_initialized():
            return
        dist.destroy_process_group(group)
        if _owns_default and not _groups:
            dist.destroy_process_group()
            _owns_default = False


def with_process_group(ctx: EngineContext) -> tuple[EngineContext, Any | None]:
    """``ctx`` as given when it has a process group; otherwise (one rank) a copy holding a
    size-1 group acquired here, and that group, which the caller releases with
    :func:`release_single_rank_group` when the engine or rollout is done with it.
    Raises :class:`GeartrainError` for ``world_size > 1`` without a group."""
    if ctx.process_group is not None:
        return ctx, None
    if ctx.world_size != 1:
        raise GeartrainError(
            f"EngineContext(role={ctx.role!r}, world_size={ctx.world_size}) has no process_group: a role on "
            "several ranks needs the torch.distributed group of its ranks (the Ray placement passes it); "
            "build such contexts through a worker group, or pass process_group="
        )
    group = acquire_single_rank_group(ctx.device)
    return dataclasses.replace(ctx, process_group=group), group
