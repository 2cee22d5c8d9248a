"""The worker-group boundary.

A worker group holds ``world_size`` ranks of one role; each rank owns one *worker* object
(built from a class and constructor arguments, so a remote placement can build it on the
other side). The driver calls a method on the group and says how the arguments and results
are laid out:

* ``Dispatch.ALL``: every rank gets the same arguments (SPMD); the result of rank 0 is
  returned (collective calls return the same value everywhere).
* ``Dispatch.DP``: the first argument is a :class:`~geartrain.batch.Batch`, split into
  the ranks' data-parallel slices (``Batch.split``); each rank's result is a
  :class:`~geartrain.batch.Batch` or a :class:`~geartrain.types.StepOutput`, and the
  group concatenates them back in the original order.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import Any

from geartrain.batch import Batch
from geartrain.cluster.process_group import acquire_single_rank_group, release_single_rank_group
from geartrain.errors import ConfigError
from geartrain.types import EngineContext


class Dispatch(enum.Enum):
    ALL = "all"
    DP = "dp"


class WorkerGroup(ABC):
    """``world_size`` ranks of one role, each holding one worker."""

    role: str
    world_size: int

    @abstractmethod
    def call(self, method: str, *args: Any, dispatch: Dispatch = Dispatch.ALL, **kwargs: Any) -> Any:
        """Call ``worker.<method>(*args, **kwargs)`` on every rank (see the module
        docstring for ``dispatch``) and return the combined result."""

    def shutdown(self) -> None:
        """Stop the ranks and free what they hold."""


class InlineWorkerGroup(WorkerGroup):
    """One rank in the driver's own process: calls are plain method calls.

    The rank's context carries a process group of size 1 (see
    :mod:`geartrain.cluster.process_group`), released again by :meth:`shutdown`."""

    def __init__(self, role: str, worker_cls: type, *args: Any, seed: int = 0, **kwargs: Any) -> None:
        self.role = role
        self.world_size = 1
        device = _device()
        group = acquire_single_rank_group(device)
        self.ctx = EngineContext(
            role=role, rank=0, world_size=1, local_rank=0, device=device, seed=seed, process_group=group
        )
        try:
            self.worker = worker_cls(*args, ctx=self.ctx, **kwargs)
        except BaseException:
            release_single_rank_group(group)
            raise

    def call(self, method: str, *args: Any, dispatch: Dispatch = Dispatch.ALL, **kwargs: Any) -> Any:
        if dispatch is Dispatch.DP and (not args or not isinstance(args[0], Batch)):
            raise TypeError(f"{self.role}.{method}: Dispatch.DP needs a Batch as the first argument")
        return getattr(self.worker, method)(*args, **kwargs)

    def shutdown(self) -> None:
        close = getattr(self.worker, "close", None)
        try:
            if close is not None:
                close()
        finally:
            self.worker = None
            if self.ctx.process_group is not None:
                release_single_rank_group(self.ctx.process_group)
                self.ctx.process_group = None


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def create_worker_group(placement: str, role: str, worker_cls: type, *args: Any, seed: int = 0, **kwargs: Any) -> WorkerGroup:
    """A worker group of ``placement`` (``inline``; ``ray`` is not built yet) running
    ``worker_cls(*args, ctx=..., **kwargs)`` on each rank."""
    if placement == "inline":
        return InlineWorkerGroup(role, worker_cls, *args, seed=seed, **kwargs)
    raise ConfigError([("cluster.placement", f"placement '{placement}' is not available yet; use 'inline'")])
