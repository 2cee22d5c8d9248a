"""The worker-group boundary.

A worker group holds ``world_size`` ranks of one role; each rank owns one *worker* object
(built from a class and constructor arguments, so a remote placement can build it on the
other side). The driver calls a method on the group and says how the arguments and results
are laid out:

* ``Dispatch.ALL``: every rank gets the same arguments (SPMD); the result of rank 0 is
  returned (collective calls return the same value everywhere).
* ``Dispatch.DP``: the first argument is a :class:`~geartrain.batch.Batch` (or a list of
  them: mini-batches, each split), divided into the ranks' data-parallel slices by the
  backend's ``data_parallel_coordinates`` (ranks of one TP/SP/PP group get the same slice),
  balanced by token count unless ``cluster.balance_tokens`` is off. Results are gathered
  back in the caller's row order (:func:`geartrain.cluster.dispatch.gather`): batches,
  step outputs, per-row tensors and lists are concatenated, metric dicts reduced.

A :class:`Placement` creates the groups of one job and owns what they share (the Ray
instance, the ranks colocated roles live in); ``make_placement`` picks it from
``cluster.placement``.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from abc import ABC, abstractmethod
from typing import Any

from geartrain.batch import Batch
from geartrain.cluster.deadlines import CallWatchdog, call_deadlines, call_phase, phase_setting
from geartrain.cluster.process_group import acquire_single_rank_group, release_single_rank_group
from geartrain.errors import ConfigError
from geartrain.types import EngineContext

log = logging.getLogger(__name__)


class Dispatch(enum.Enum):
    ALL = "all"
    DP = "dp"


class WorkerGroup(ABC):
    """``world_size`` ranks of one role, each holding one worker."""

    role: str
    world_size: int
    overlaps: bool = False
    """Whether :meth:`submit` returns before the call ran (the ranks are other processes),
    so that a submitted call's transfer and work overlap what the driver does next."""

    @abstractmethod
    def call(self, method: str, *args: Any, dispatch: Dispatch = Dispatch.ALL, **kwargs: Any) -> Any:
        """Call ``worker.<method>(*args, **kwargs)`` on every rank (see the module
        docstring for ``dispatch``) and return the combined result."""

    def submit(self, method: str, *args: Any, dispatch: Dispatch = Dispatch.ALL, **kwargs: Any) -> PendingCall:
        """Start :meth:`call` and return without waiting for it: calls submitted to one
        group run on its ranks in submission order; ``result()`` waits and combines. This
        default runs the call at once (a placement whose ranks are other processes
        overrides it)."""
        try:
            return PendingCall(value=self.call(method, *args, dispatch=dispatch, **kwargs))
        except Exception as exc:  # noqa: BLE001 - raised again by result()
            return PendingCall(error=exc)

    def submit_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> PendingCall:
        """Like :meth:`submit`, on rank ``rank`` only (its result uncombined): ordered with
        the other calls to that rank. This default serves a one-rank group."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"{self.role}: rank {rank} out of range (world size {self.world_size})")
        if self.world_size != 1:
            raise NotImplementedError(f"{type(self).__name__} cannot call one rank of {self.world_size}")
        return self.submit(method, *args, **kwargs)

    def replace_rank(self, rank: int) -> None:
        """Start a new rank in place of rank ``rank``, which died, with a new worker built
        as the first was (the caller restores its state). Placements whose ranks cannot
        die alone (this default) refuse."""
        raise NotImplementedError(f"{type(self).__name__} cannot replace a rank")

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the ranks and free what they hold (abstract: every group holds something, a
        process group or rank processes, and a no-op default would leak it silently)."""


class PendingCall:
    """A submitted call (:meth:`WorkerGroup.submit`): ``result()`` waits for it once."""

    def __init__(self, *, value: Any = None, error: BaseException | None = None, wait: Any = None) -> None:
        self._value, self._error, self._wait = value, error, wait

    def result(self) -> Any:
        if self._wait is not None:
            wait, self._wait = self._wait, None
            try:
                self._value = wait()
            except BaseException as exc:
                self._error = exc
        if self._error is not None:
            raise self._error
        return self._value


class InlineWorkerGroup(WorkerGroup):
    """One rank in the driver's own process: calls are plain method calls.

    The rank's context carries a process group of size 1 (see
    :mod:`geartrain.cluster.process_group`), released again by :meth:`shutdown`."""

    def __init__(
        self,
        role: str,
        worker_cls: type,
        *args: Any,
        seed: int = 0,
        deadlines: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        self.role = role
        self.world_size = 1
        self.deadlines = deadlines
        device = _device()
        group = acquire_single_rank_group(device)
        self.ctx = EngineContext(
            role=role, rank=0, world_size=1, local_rank=0, device=device, seed=seed, process_group=group
        )
        try:
            with self._deadline("build"):
                self.worker = worker_cls(*args, ctx=self.ctx, **kwargs)
        except BaseException:
            release_single_rank_group(group)
            raise

    def _deadline(self, method: str) -> contextlib.AbstractContextManager[Any]:
        """The watchdog of a call of ``method`` (``deadlines``: by phase; ``None``: no deadline)."""
        if self.deadlines is None:
            return contextlib.nullcontext()
        return CallWatchdog(f"{self.role}.{method}", self.deadlines[call_phase(method)], phase_setting(method))

    def call(self, method: str, *args: Any, dispatch: Dispatch = Dispatch.ALL, **kwargs: Any) -> Any:
        if dispatch is Dispatch.DP and not _is_dp_argument(args):
            raise TypeError(
                f"{self.role}.{method}: Dispatch.DP needs a Batch, or a list of Batches, as the first argument"
            )
        with self._deadline(method):
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


def _is_dp_argument(args: tuple[Any, ...]) -> bool:
    if not args:
        return False
    first = args[0]
    return isinstance(first, Batch) or (
        isinstance(first, list) and bool(first) and all(isinstance(b, Batch) for b in first)
    )


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def create_worker_group(
    placement: str, role: str, worker_cls: type, *args: Any, seed: int = 0, **kwargs: Any
) -> WorkerGroup:
    """An ``inline`` worker group running ``worker_cls(*args, ctx=..., **kwargs)``. Groups
    on other placements come from a :class:`Placement` (``make_placement``), which owns
    what they share."""
    if placement == "inline":
        return InlineWorkerGroup(role, worker_cls, *args, seed=seed, **kwargs)
    raise ConfigError(
        [("cluster.placement", f"placement '{placement}' needs a Placement: use geartrain.cluster.make_placement")]
    )


class Placement(ABC):
    """Creates a job's worker groups and frees what they share on :meth:`close`."""

    @abstractmethod
    def group(
        self,
        role: str,
        worker_cls: type,
        *args: Any,
        world_size: int = 1,
        pool: str | None = None,
        seed: int = 0,
        resources: Any = None,
        **kwargs: Any,
    ) -> WorkerGroup:
        """A group of ``world_size`` ranks each running ``worker_cls(*args, ctx=..., **kwargs)``.
        Roles given the same ``pool`` name live in the same processes (colocation); ``None``
        gives the role processes of its own. ``resources`` (a
        :class:`~geartrain.trainer.config.RankResources`) is what each rank of a new pool
        reserves where the placement reserves anything (default: ``cluster.resources_per_rank``)."""

    def close(self, graceful: bool = True) -> None:  # noqa: B027 - a deliberate no-op default (see docstring)
        """Stop every rank this placement started (``graceful``: let each rank close its
        workers first; otherwise stop them at once, e.g. after an error or Ctrl-C). This
        default does nothing, for placements that start no processes of their own (the inline
        one: each group frees its rank in :meth:`WorkerGroup.shutdown`)."""

    def __enter__(self) -> Placement:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InlinePlacement(Placement):
    """Every role is one rank in the driver's process. Given ``cluster`` (a
    :class:`~geartrain.trainer.config.ClusterConfig`), each call into a role's worker is held
    to its phase's deadline (``cluster.call_timeout_s``; :mod:`geartrain.cluster.deadlines`)."""

    def __init__(self, cluster: Any = None) -> None:
        self.deadlines = call_deadlines(cluster) if cluster is not None else None
        self._groups: list[InlineWorkerGroup] = []

    def group(
        self,
        role: str,
        worker_cls: type,
        *args: Any,
        world_size: int = 1,
        pool: str | None = None,
        seed: int = 0,
        resources: Any = None,
        **kwargs: Any,
    ) -> WorkerGroup:
        if world_size != 1:
            raise ConfigError(
                [
                    (
                        f"{role}.engine.parallel",
                        f'the inline placement runs 1 rank, not {world_size}; set cluster.placement = "ray"',
                    )
                ]
            )
        group = InlineWorkerGroup(role, worker_cls, *args, seed=seed, deadlines=self.deadlines, **kwargs)
        self._groups.append(group)
        return group

    def close(self, graceful: bool = True) -> None:
        """Shut down every group this placement made that is still up, newest first (shutting
        one down twice does nothing). A job that ends well has shut its groups down already;
        one that failed midway has not, and its engines and this process's torch.distributed
        group would outlive it, tripping the next job run in the same process (the Python
        API). A group whose close raises is logged and the others are still shut down: this
        runs while another error is on its way to the caller."""
        groups, self._groups = self._groups, []
        for group in reversed(groups):
            try:
                group.shutdown()
            except Exception as exc:  # noqa: BLE001 - the job's own error is the one to report
                log.warning("closing the inline %s role failed: %s: %s", group.role, type(exc).__name__, exc)
