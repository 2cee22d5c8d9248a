"""The ``ray`` placement: every rank is a Ray actor (needs ``pip install './core[ray]'`` from a checkout).

* A **rank pool** is ``world_size`` Ray actors (:class:`RankHost`) reserved together in a
  placement group (bundles of ``cluster.resources_per_rank``, ``PACK``: a pool's ranks fill
  one node before the next). The pool's ranks form one ``torch.distributed`` world (gloo on
  CPU, NCCL on GPU; rank 0's node is the rendezvous), and that world is every hosted role's
  ``EngineContext.process_group``.
* **Colocation**: several roles may live in one pool (the actor, its rollout and the
  reference of one rank share a process), so the hybrid engine's weight sync stays inside
  each process. A role given no pool gets one of its own.
* **Failures**: a rank that dies or raises ends the call at once with a
  :class:`RankFailure` naming the role, rank, node and the last lines of the rank's log;
  a rank that stops answering (stopped, stuck holding the GIL, its node unreachable) is
  found by its **heartbeat** (a thread in each rank touches ``<pool>-rank<r>.beat`` in the
  log directory every second; ``cluster.heartbeat_timeout_s`` without one ends the call,
  naming it, rather than blaming the healthy peer whose collective timed out), and every
  wait has a **deadline** by phase (``cluster.call_timeout_s``: build, step, checkpoint);
  a rank pool that cannot be scheduled (not enough CPUs/GPUs) is refused after
  ``cluster.startup_timeout_s`` with what it asked for and what the cluster has, never a
  silent pending actor.
* ``cluster.address`` joins a running cluster; otherwise a local Ray instance is started
  (no dashboard, no usage stats, no token auth) and stopped by :meth:`RayPlacement.close`,
  or, if the driver is killed, by a reaper process the moment it dies
  (:mod:`geartrain.cluster.ray_reaper`).

Each rank writes its output (stdout and stderr, C libraries included) to
``<log_dir>/<pool>-rank<r>.log``, where a rank killed by a fatal signal (SIGSEGV, SIGABRT,
SIGBUS, SIGFPE, SIGILL) also leaves every one of its threads' Python stacks
(``faulthandler``); on a multi-node cluster ``log_dir`` must be on a shared filesystem for
the driver to quote a failed rank's log (as checkpoints must be). Without a ``log_dir`` the
logs go to a temporary directory, removed by :meth:`RayPlacement.close` unless an error
quoted a log in it.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

from geartrain.cluster.deadlines import call_deadlines, call_phase, phase_setting
from geartrain.cluster.dispatch import dp_rows, gather, reduce_metrics, shard_value
from geartrain.cluster.worker_group import Dispatch, PendingCall, Placement, WorkerGroup, _is_dp_argument
from geartrain.errors import ConfigError, GeartrainError
from geartrain.types import DataParallelCoordinates, EngineContext

INSTALL_HINT = "pip install './core[ray]'  (from the root of a geartrain checkout; or: pip install ray numpy)"
LOG_TAIL_LINES = 20
HEARTBEAT_EVERY_S = 1.0
#: Ray starts its worker processes at nice 15 by default (to keep its own daemons responsive),
#: which makes a rank, the job's whole workload, yield to any ordinary process: beside a CPU
#: hog of normal priority a rank got a few percent of a core, took minutes to import torch and
#: missed start-up deadlines (issue 35). A local cluster started here runs them at nice 0.
RAY_WORKER_NICENESS = "0"


#: What a rank does in each start-up call, for the messages (they are no user's method names)
_START_UP = {
    "where": "start-up (reporting its host)",
    "rendezvous_address": "start-up (the rendezvous address)",
    "init_distributed": "start-up (joining torch.distributed)",
    "init_alone": "start-up (a replacement rank's process group)",
}
#: the setting of the start-up calls' deadline
STARTUP_SETTING = "cluster.startup_timeout_s"


def doing(method: str) -> str:
    """``method`` as the messages name it: a start-up call by what it does."""
    return _START_UP.get(method, method)


def deadline_setting(method: str) -> str:
    """The setting whose value is the deadline of a call of ``method``."""
    return STARTUP_SETTING if method in _START_UP else phase_setting(method)


def deadline_reason(limit: float, method: str, started: bool = True) -> str:
    """Why a rank that did not answer ``method`` within ``limit`` seconds is reported: the
    deadline, the setting it comes from, and whether its process had started (its heartbeat
    goes on) or not (no heartbeat yet: still scheduled or importing)."""
    state = (
        "although its heartbeat goes on (a deadlock, or the phase needs longer)"
        if started
        else "and its process had not started (no heartbeat yet: Ray had not scheduled it, or it was still "
        "importing; on a loaded machine raise the setting)"
    )
    return f"it did not answer within the {limit:g} s deadline of this phase ({deadline_setting(method)}) {state}"


class RankFailure(GeartrainError):
    """A rank died or raised; the message names role, rank, node and its last log lines.

    ``role`` and ``rank`` say which rank failed (``None`` when several did not answer) and
    ``died`` whether its process ended (killed, out of memory, crashed), as opposed to
    raising or hanging: a caller may replace a dead rank (:meth:`RayWorkerGroup.replace_rank`)."""

    def __init__(self, message: str, *, role: str | None = None, rank: int | None = None, died: bool = False) -> None:
        super().__init__(message)
        self.role, self.rank, self.died = role, rank, died


def require_ray() -> None:
    """Raise a clear error when Ray is not installed."""
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        raise GeartrainError(
            f"cluster.placement = 'ray' needs Ray, which is not installed here; install it with: {INSTALL_HINT}"
        ) from exc


def ray_environment() -> None:
    """Environment Ray reads at start-up: no token auth (it would write a token file in the
    home directory), no usage stats, its own temporary directory, and worker processes at the
    driver's CPU priority (:data:`RAY_WORKER_NICENESS`). Caller's values win."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_worker_niceness", RAY_WORKER_NICENESS)
    os.environ.setdefault("RAY_TMPDIR", os.path.join(tempfile.gettempdir(), "geartrain-ray"))
    Path(os.environ["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)


#: environment variables that change how native code checks memory (glibc's malloc checks,
#: a preloaded debugging allocator): a rank names those set in its log
NATIVE_DEBUG_VARIABLES = ("MALLOC_CHECK_", "MALLOC_PERTURB_", "GLIBC_TUNABLES", "LD_PRELOAD")


def native_debug_environment() -> str:
    """``NAME=value`` for each of :data:`NATIVE_DEBUG_VARIABLES` set here, space separated
    ("" when none is): a crash log then says whether the heap checks were on."""
    return " ".join(f"{name}={os.environ[name]}" for name in NATIVE_DEBUG_VARIABLES if os.environ.get(name))


class Timed(NamedTuple):
    """A rank's result, the seconds its method ran and when it ended (``time.time()``)."""

    value: Any
    seconds: float
    ended: float


# ----------------------------------------------------------------------------- in the actor


class RankHost:
    """One rank: a process hosting the worker objects of every role of its pool."""

    def __init__(self, pool: str, rank: int, world_size: int, log_path: str, threads: int, device: str) -> None:
        self.pool, self.rank, self.world_size, self.device = pool, rank, world_size, device
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        # Ray enables faulthandler for the crashing thread alone; a native abort (heap
        # corruption, a segfault in a library) needs every thread's Python stack to say
        # which threads were doing what at that moment (issue 38).
        faulthandler.enable(file=sys.stderr, all_threads=True)
        import torch

        torch.set_num_threads(max(1, threads))
        self.workers: dict[str, Any] = {}
        self._beat_path = str(Path(log_path).with_suffix(".beat"))
        import threading

        threading.Thread(target=self._heartbeat, name="geartrain-heartbeat", daemon=True).start()
        import ray

        node = ray.get_runtime_context().get_node_id()
        self._log(
            f"rank {rank} of {world_size} in pool '{pool}', pid {os.getpid()}, "
            f"node {socket.gethostname()} (Ray node {node})"
        )
        debug = native_debug_environment()
        if debug:
            self._log(f"native debugging settings: {debug}")
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        if nice > 0:
            self._log(
                f"this rank runs at nice {nice} (Ray's worker_niceness): it yields the CPU to every process of "
                "normal priority; start the cluster with RAY_worker_niceness=0 to run ranks at full priority"
            )

    def _heartbeat(self) -> None:
        """Touch the beat file every second for as long as this process runs (a stopped
        or GIL-starved process stops touching it; see the module docstring)."""
        while True:
            try:
                with open(self._beat_path, "a"):
                    os.utime(self._beat_path)
            except OSError:
                pass
            time.sleep(HEARTBEAT_EVERY_S)

    def _log(self, text: str) -> None:
        print(f"[geartrain {time.strftime('%H:%M:%S')}] {text}", flush=True)

    def where(self) -> dict[str, Any]:
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "host": socket.gethostname(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
        }

    def cpu_seconds(self) -> float:
        """CPU time this rank's process has used (for benchmarks)."""
        return time.process_time()

    def rendezvous_address(self) -> tuple[str, int]:
        import ray

        from geartrain.cluster.ports import free_port

        return ray.util.get_node_ip_address(), free_port()

    def init_distributed(self, address: str, port: int, timeout_s: float) -> None:
        import torch.distributed as dist

        backend = "nccl" if self.device == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{address}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        self._log(f"torch.distributed ({backend}) ready: rank {self.rank} of {self.world_size}")

    def init_alone(self) -> None:
        """A ``torch.distributed`` world of this process alone: a rank started in place of
        a dead one cannot join its pool's world (see :meth:`RankPool.replace`)."""
        import torch.distributed as dist

        backend = "nccl" if self.device == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        self._log(f"torch.distributed ({backend}) ready: a world of its own (in place of rank {self.rank})")

    def add(
        self, role: str, worker_cls: type, args: tuple[Any, ...], kwargs: dict[str, Any], seed: int
    ) -> tuple[int, int]:
        """Build ``role``'s worker here; returns its data-parallel coordinates."""
        import torch.distributed as dist

        self._log(f"building {role} ({worker_cls.__name__})")
        ctx = EngineContext(
            role=role,
            rank=self.rank,
            world_size=self.world_size,
            local_rank=0,
            device=self.device,
            seed=seed,
            process_group=dist.group.WORLD,
        )
        worker = worker_cls(*args, ctx=ctx, **kwargs)
        self.workers[role] = worker
        coords = getattr(getattr(worker, "engine", None), "dp", None)
        if not isinstance(coords, DataParallelCoordinates):
            coords = DataParallelCoordinates(rank=self.rank, size=self.world_size)
        return coords.rank, coords.size

    def call(self, role: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Timed:
        """``method``'s result with the seconds it ran here (the driver subtracts them from
        the call's wall time to know what the dispatch cost)."""
        self._log(f"{role}.{method}")
        start = time.perf_counter()
        value = getattr(self.workers[role], method)(*args, **kwargs)
        return Timed(value, time.perf_counter() - start, time.time())

    # Ray resolves object refs passed as top-level arguments: arguments shared by every
    # rank travel as one ``(args, kwargs)`` pair (through the object store once when large).
    def add_shared(
        self, role: str, worker_cls: type, shared: tuple[tuple[Any, ...], dict[str, Any]], seed: int
    ) -> tuple[int, int]:
        return self.add(role, worker_cls, shared[0], shared[1], seed)

    def call_shared(self, role: str, method: str, shared: tuple[tuple[Any, ...], dict[str, Any]]) -> Timed:
        return self.call(role, method, shared[0], shared[1])

    def call_share(self, role: str, method: str, share: Any, rest: tuple[tuple[Any, ...], dict[str, Any]]) -> Timed:
        """``method(share, *rest_args, **rest_kwargs)``: ``share`` is this rank's slice."""
        return self.call(role, method, (share, *rest[0]), rest[1])

    def remove(self, role: str) -> None:
        worker = self.workers.pop(role, None)
        close = getattr(worker, "close", None)
        if close is not None:
            close()
        self._log(f"removed {role}")

    def close(self) -> None:
        for role in list(self.workers):
            self.remove(role)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- the driver's side


class RankPool:
    """``size`` ranks reserved together; see the module docstring."""

    def __init__(self, name: str, size: int, cluster: Any, log_dir: Path, resources: Any = None) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        self.name, self.size = name, size
        self.logs_named = False
        self.timeout_s = cluster.startup_timeout_s
        self.heartbeat_timeout_s = float(getattr(cluster, "heartbeat_timeout_s", 30.0))
        self.call_timeouts = call_deadlines(cluster)
        res = resources if resources is not None else cluster.resources_per_rank
        bundle = {"CPU": res.cpus, **({"GPU": res.gpus} if res.gpus else {})}
        need = {k: v * size for k, v in bundle.items()}
        total = ray.cluster_resources()
        short = {k: (v, total.get(k, 0.0)) for k, v in need.items() if total.get(k, 0.0) < v}
        if short:
            raise ConfigError([("cluster.resources_per_rank", self._short_message(short, bundle))])
        self.pg = placement_group(
            [dict(bundle) for _ in range(size)], strategy="PACK", name=f"geartrain-{name}-{os.getpid()}"
        )
        ready, _ = ray.wait([self.pg.ready()], timeout=self.timeout_s)
        if not ready:
            available = ray.available_resources()
            remove_placement_group(self.pg)
            short = {k: (v, available.get(k, 0.0)) for k, v in need.items()}
            raise ConfigError(
                [("cluster.resources_per_rank", self._short_message(short, bundle, waited=self.timeout_s))]
            )
        self.log_paths = [str(log_dir / f"{name}-rank{r}.log") for r in range(size)]
        self.beat_paths = [str(Path(p).with_suffix(".beat")) for p in self.log_paths]
        for beat in self.beat_paths:  # a previous run's (a resume into the same directory) is not these ranks'
            Path(beat).unlink(missing_ok=True)
        self.resources, self.device = res, ("cuda" if res.gpus else "cpu")
        self.roles: list[str] = []
        """The roles built on these ranks (:meth:`RayWorkerGroup.replace_rank` needs one)."""
        self.hosts: list[Any] = []
        self.where: list[dict[str, Any]] = [{"host": "?", "node_id": "?"} for _ in range(size)]
        try:
            self.hosts = [self._start(r) for r in range(size)]
            self.where = self.get(
                [h.where.remote() for h in self.hosts], "(start-up)", "where", deadline_s=self.timeout_s
            )
            address, port = self.get(
                [self.hosts[0].rendezvous_address.remote()],
                "(start-up)",
                "rendezvous_address",
                deadline_s=self.timeout_s,
            )[0]
            self.get(
                [h.init_distributed.remote(address, port, self.timeout_s) for h in self.hosts],
                "(start-up)",
                "init_distributed",
                deadline_s=self.timeout_s,
            )
        except BaseException:
            # A pool that failed to start holds nothing: its ranks and its placement group
            # (named after this process) go, so the next pool of that name can start.
            self._release()
            raise

    def _release(self) -> None:
        """Kill this pool's rank processes and remove its placement group (idempotent)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for host in self.hosts:
            try:
                ray.kill(host)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.hosts = []
        try:
            remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001 - already removed
            pass

    def _start(self, rank: int) -> Any:
        """A new :class:`RankHost` actor for ``rank``, on that rank's bundle."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        res = self.resources
        return (
            ray.remote(RankHost)
            .options(
                num_cpus=res.cpus,
                num_gpus=res.gpus,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=rank
                ),
            )
            .remote(self.name, rank, self.size, self.log_paths[rank], int(res.cpus), self.device)
        )

    def replace(self, rank: int) -> None:
        """Start a new process in place of ``rank`` (dead: its actor is killed first, if
        anything is left of it), on the same bundle of the placement group, logging to
        the same file. It holds no worker yet, and it is not a member of the pool's
        ``torch.distributed`` world (a gloo or NCCL world takes no new member): it gets a
        world of its own, so only a role whose ranks use no collective among themselves
        (the separate rollout's replicas) can be rebuilt on it."""
        import ray

        try:
            ray.kill(self.hosts[rank])
        except Exception:  # noqa: BLE001 - already gone
            pass
        Path(self.beat_paths[rank]).unlink(missing_ok=True)  # the new process's beat is not there yet
        self.hosts[rank] = self._start(rank)
        self.where[rank] = self.get(
            [self.hosts[rank].where.remote()], "(start-up)", "where", deadline_s=self.timeout_s, ranks=[rank]
        )[0]
        self.get(
            [self.hosts[rank].init_alone.remote()], "(start-up)", "init_alone", deadline_s=self.timeout_s, ranks=[rank]
        )

    def _short_message(
        self, short: dict[str, tuple[float, float]], bundle: dict[str, float], waited: float | None = None
    ) -> str:
        parts = ", ".join(
            f"{k} {need:g} (the cluster has {have:g}{' free' if waited else ''})" for k, (need, have) in short.items()
        )
        when = f" within {waited:g} s" if waited else ""
        return (
            f"the '{self.name}' ranks ({self.size} x {bundle}) could not be placed{when}: they need {parts}; "
            "lower cluster.resources_per_rank (e.g. cpus = 0.5), fewer ranks, or add nodes"
        )

    # ------------------------------------------------------------------ calls
    def get(
        self,
        refs: Sequence[Any],
        role: str,
        method: str,
        *,
        deadline_s: float | None = None,
        ranks: Sequence[int] | None = None,
    ) -> list[Any]:
        """Every call's result, in the order of ``refs``; the first failure ends the wait at
        once, and so do a rank whose heartbeat stopped and the phase's deadline
        (``deadline_s``, else :func:`call_phase`'s from ``cluster.call_timeout_s``), naming
        the ranks that did not answer. ``refs[i]`` is rank ``ranks[i]``'s call (default:
        rank ``i``'s)."""
        import ray

        position = {ref: i for i, ref in enumerate(refs)}
        index = {ref: (ranks[i] if ranks is not None else i) for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        started = time.monotonic()
        limit = deadline_s if deadline_s is not None else self.call_timeouts[call_phase(method)]
        beats = _Heartbeats(self.beat_paths)
        while pending:
            # a bounded wait: control returns to Python every second, so Ctrl-C is handled
            ready, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in ready:
                try:
                    results[position[ref]] = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                    self._fail(index[ref], exc, pending, index, role, method)
            if not pending:
                break
            waiting = sorted({index[ref] for ref in pending})
            hung = beats.silent([r for r in waiting if r < self.size], self.heartbeat_timeout_s)
            if hung:
                self._no_answer(
                    hung,
                    role,
                    method,
                    f"its heartbeat stopped {self.heartbeat_timeout_s:g} s ago "
                    "(the process is stopped, stuck in native code holding the GIL, or its node is unreachable)",
                )
            if time.monotonic() - started > limit:
                beating = any(beats.has_beaten(r) for r in waiting if r < self.size)
                self._no_answer(waiting, role, method, deadline_reason(limit, method, started=beating))
        return results

    def _who(self, rank: int, role: str) -> str:
        where = self.where[rank]
        who = f"role '{role}' rank {rank} of {self.size} (pool '{self.name}')"
        if "pid" not in where:  # it never answered where(): nothing is known of its process
            return f"{who}, whose process never reported where it runs,"
        return f"{who} on node {where.get('host')} (Ray node {str(where.get('node_id'))[:12]}, pid {where.get('pid')})"

    def _log_lines(self, rank: int) -> str:
        """``; last lines of its log PATH:`` and them, or that the log does not exist yet (the
        rank's process never started: it opens its log first)."""
        path = self.log_paths[rank]
        self.logs_named = True  # an error quotes this log: it must outlive the placement
        if not os.path.exists(path):
            return f"; its log {path} does not exist yet (the process never started)"
        return f"; last lines of its log {path}:\n{_tail(path)}"

    def _no_answer(self, ranks: list[int], role: str, method: str, why: str) -> None:
        """Raise the :class:`RankFailure` for ``ranks``, which did not answer ``method``."""
        parts = [
            f"{self._who(r, role)} did not answer during {doing(method)}: {why}{self._log_lines(r)}" for r in ranks
        ]
        raise RankFailure("\n".join(parts), role=role, rank=ranks[0] if len(ranks) == 1 else None)

    def _fail(
        self, rank: int, exc: Exception, pending: list[Any], index: dict[Any, int], role: str, method: str
    ) -> None:
        import ray

        # A peer of a dead rank fails too ("connection closed by peer"), and so does the
        # peer of a hung one once its collective times out: a rank that stopped answering
        # is reported in preference to one that only lost its peer.
        if pending:
            hung = _Heartbeats(self.beat_paths).silent(
                sorted({index[ref] for ref in pending}), self.heartbeat_timeout_s, now_only=True
            )
            if hung:
                self._no_answer(
                    hung,
                    role,
                    method,
                    f"its heartbeat has stopped for over {self.heartbeat_timeout_s:g} s, "
                    f"and rank {rank}'s error is its peer's wait on it timing out",
                )
        # give the others a moment and report a rank that died in preference to one that
        # only lost its peer
        failures = {rank: exc}
        if pending:
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=3.0)
            for ref in ready:
                try:
                    ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as other:
                    failures[index[ref]] = other
        died = [r for r, e in sorted(failures.items()) if isinstance(e, ray.exceptions.RayActorError)]
        rank = died[0] if died else min(failures)
        exc = failures[rank]
        who = self._who(rank, role)
        cause = getattr(exc, "cause", None)
        if isinstance(cause, GeartrainError):
            # geartrain's own errors already say what is wrong and how to fix it: keep their type
            cause.add_note(f"(raised by {who} during {doing(method)})")
            raise cause from None
        if isinstance(exc, ray.exceptions.RayActorError):
            what = "died (its process ended: killed, out of memory or crashed)"
        else:
            lines = str(exc).strip().splitlines()
            what = "raised an error:\n" + "\n".join(f"  {line}" for line in lines[-12:])
        raise RankFailure(
            f"{who} {what}\nduring {doing(method)}{self._log_lines(rank)}",
            role=role,
            rank=rank,
            died=isinstance(exc, ray.exceptions.RayActorError),
        ) from exc

    def close(self, graceful: bool = True) -> None:
        import ray

        if graceful:
            refs = [h.close.remote() for h in self.hosts]
            ray.wait(refs, num_returns=len(refs), timeout=15.0)
        self._release()


class _Heartbeats:
    """The driver's view of the ranks' beat files: when (by the driver's clock) each was
    last seen to change, so clocks of other nodes do not matter."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        now = time.monotonic()
        self.seen = [(self._mtime(p), now) for p in paths]

    @staticmethod
    def _mtime(path: str) -> float | None:
        try:
            return os.stat(path).st_mtime
        except OSError:
            return None

    def has_beaten(self, rank: int) -> bool:
        """Whether ``rank``'s process has started its heartbeat."""
        return self._mtime(self.paths[rank]) is not None

    def silent(self, ranks: list[int], timeout_s: float, *, now_only: bool = False) -> list[int]:
        """The ranks among ``ranks`` whose beat has not changed for ``timeout_s`` (with
        ``now_only``: whose beat file is older than that by the file's own clock, for a
        one-off look)."""
        now = time.monotonic()
        silent = []
        for r in ranks:
            mtime = self._mtime(self.paths[r])
            if mtime is None:  # not started yet (still scheduled or importing): the deadline covers it
                continue
            if now_only:
                if time.time() - mtime > timeout_s:
                    silent.append(r)
                continue
            last, since = self.seen[r]
            if mtime != last:
                self.seen[r] = (mtime, now)
            elif now - since > timeout_s:
                silent.append(r)
        return silent


def _tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"  (cannot read it here: {exc})"
    return "\n".join(f"  | {line}" for line in text[-lines:]) or "  (empty)"


class DispatchStats:
    """What a group's calls cost beyond the work itself (argument transfer, result transfer,
    splitting and gathering, Ray's scheduling): for a call the driver waited on at once
    (:meth:`RayWorkerGroup.call`), its wall time on the driver minus the slowest rank's time
    inside the method; for a submitted one (:meth:`RayWorkerGroup.submit`), the time from
    its submission to its result in the driver's hands during which neither that rank
    worked on it nor the driver did anything else (the driver's own work in between is the
    step's, not the call's)."""

    def __init__(self) -> None:
        self.calls = 0
        self.wall_s = 0.0
        self.overhead_s = 0.0

    def record(self, wall_s: float, work_s: float) -> None:
        self.calls += 1
        self.wall_s += wall_s
        self.overhead_s += max(wall_s - work_s, 0.0)

    def record_submitted(self, submitted: float, waited: float, done: float, work: tuple[float, float]) -> None:
        """A submitted call (``time.time()`` readings): sent at ``submitted``, its result
        asked for at ``waited`` and in hand at ``done``; the slowest rank worked during
        ``work`` (its start and end)."""
        busy = sorted([(submitted, waited), (max(work[0], submitted), min(work[1], done))])
        covered, reach = 0.0, submitted
        for lo, hi in busy:  # the length of the two intervals' union
            lo = max(lo, reach)
            if hi > lo:
                covered += hi - lo
                reach = hi
        self.calls += 1
        self.wall_s += done - submitted
        self.overhead_s += max(done - submitted - covered, 0.0)


class RayWorkerGroup(WorkerGroup):
    """One role's worker on each rank of a :class:`RankPool`."""

    overlaps = True

    def __init__(
        self,
        pool: RankPool,
        role: str,
        worker_cls: type,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        seed: int,
        balance: bool,
    ) -> None:
        import ray

        self.pool, self.role, self.world_size, self.balance = pool, role, pool.size, balance
        shared = ray.put((args, kwargs))
        self._build = (worker_cls, shared, seed)  # what replace_rank builds again
        coords = pool.get([h.add_shared.remote(role, worker_cls, shared, seed) for h in pool.hosts], role, "build")
        pool.roles.append(role)
        self.dp_of = [c[0] for c in coords]
        self.dp_size = coords[0][1]
        self.leaders = [self.dp_of.index(d) for d in range(self.dp_size)]
        self.closed = False
        self.stats = DispatchStats()

    def call(self, method: str, *args: Any, dispatch: Dispatch = Dispatch.ALL, **kwargs: Any) -> Any:
        return self._submit(method, args, kwargs, dispatch, measure=True).result()

    def submit(self, method: str, *args: Any, dispatch: Dispatch = Dispatch.ALL, **kwargs: Any) -> PendingCall:
        """Send the call to every rank now (Ray runs an actor's calls in the order they
        were sent); ``result()`` waits for the ranks and combines their results (counted
        in :attr:`stats` as a submitted call, see :class:`DispatchStats`)."""
        return self._submit(method, args, kwargs, dispatch, measure=False)

    def _submit(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], dispatch: Dispatch, *, measure: bool
    ) -> PendingCall:
        start = time.perf_counter()
        submitted = time.time()
        hosts = self.pool.hosts
        if dispatch is Dispatch.ALL:
            shared = _by_store((args, kwargs))
            refs = [h.call_shared.remote(self.role, method, shared) for h in hosts]

            def combine(results: list[Any]) -> Any:
                return _merge_metrics(results[0], results)
        else:
            if not _is_dp_argument(args):
                raise TypeError(
                    f"{self.role}.{method}: Dispatch.DP needs a Batch, or a list of Batches, as the first argument"
                )
            rows = dp_rows(args[0], self.dp_size, balance=self.balance)
            shares = [shard_value(args[0], rows[d]) for d in range(self.dp_size)]
            rest = _by_store((args[1:], kwargs))
            refs = [h.call_share.remote(self.role, method, shares[self.dp_of[r]], rest) for r, h in enumerate(hosts)]
            total = len(args[0]) if not isinstance(args[0], list) else len(args[0][0])

            def combine(results: list[Any]) -> Any:
                merged = gather([results[r] for r in self.leaders], [rows[d][0] for d in range(self.dp_size)], total)
                return _merge_metrics(merged, results)

        def wait() -> Any:
            waited = time.time()
            timed = self.pool.get(refs, self.role, method)
            value = combine([t.value for t in timed])
            slowest = max(timed, key=lambda t: t.seconds)
            if measure:
                self.stats.record(time.perf_counter() - start, slowest.seconds)
            else:
                work = (slowest.ended - slowest.seconds, slowest.ended)
                self.stats.record_submitted(submitted, waited, time.time(), work)
            return value

        return PendingCall(wait=wait)

    def submit_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> PendingCall:
        """``method`` on rank ``rank`` alone (the separate rollout routes requests to one
        replica): sent now, in order with that rank's other calls."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"{self.role}: rank {rank} out of range (world size {self.world_size})")
        ref = self.pool.hosts[rank].call_shared.remote(self.role, method, _by_store((args, kwargs)))
        return PendingCall(wait=lambda: self.pool.get([ref], self.role, method, ranks=[rank])[0].value)

    def replace_rank(self, rank: int) -> None:
        """A new process in place of rank ``rank`` (which died), holding a new worker built
        from the group's arguments (:meth:`RankPool.replace`: not in the pool's
        ``torch.distributed`` world). Only for a role alone in its pool: the ranks of
        colocated roles share one process."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"{self.role}: rank {rank} out of range (world size {self.world_size})")
        if self.pool.roles != [self.role]:
            raise GeartrainError(
                f"cannot replace rank {rank} of '{self.role}': its process also hosts {', '.join(self.pool.roles)}"
            )
        worker_cls, shared, seed = self._build
        self.pool.replace(rank)
        self.pool.get(
            [self.pool.hosts[rank].add_shared.remote(self.role, worker_cls, shared, seed)],
            self.role,
            "build",
            ranks=[rank],
        )

    def shutdown(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool.get([h.remove.remote(self.role) for h in self.pool.hosts], self.role, "shutdown")


#: Arguments with more tensor bytes than this travel through Ray's object store once for
#: every rank; smaller ones ride inside each call (a put and a fetch per rank cost more
#: round trips than copying a few kilobytes).
INLINE_ARGUMENT_BYTES = 64 << 10


def _tensor_bytes(value: Any, depth: int = 0) -> int:
    """Bytes of the tensors in ``value`` (tensors, batches, and containers of them)."""
    import torch

    from geartrain.batch import Batch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Batch):
        return sum(t.numel() * t.element_size() for t in value.tensors.values())
    if depth < 4 and isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v, depth + 1) for v in value)
    if depth < 4 and isinstance(value, dict):
        return sum(_tensor_bytes(v, depth + 1) for v in value.values())
    return 0


def _by_store(value: Any) -> Any:
    """``value`` itself, or an object-store reference to it when it is large."""
    import ray

    return ray.put(value) if _tensor_bytes(value) > INLINE_ARGUMENT_BYTES else value


def _merge_metrics(value: Any, per_rank: list[Any]) -> Any:
    """Metric dicts (alone or inside a tuple) reduced over every rank, not only the
    data-parallel leaders: each rank switches phases and syncs weights."""
    if isinstance(value, dict):
        return reduce_metrics(per_rank)
    if isinstance(value, tuple):
        return tuple(
            reduce_metrics([r[i] for r in per_rank]) if isinstance(v, dict) else v for i, v in enumerate(value)
        )
    return value


def _start_reaper() -> Any:
    """The process that stops this driver's local Ray instance if the driver is killed
    (:mod:`geartrain.cluster.ray_reaper`); ``None`` where the session is not known."""
    from geartrain.cluster.ray_reaper import start_reaper

    try:
        from ray._private import worker

        session_dir = worker._global_node.get_session_dir_path()
    except Exception:  # noqa: BLE001 - a Ray without this (private) accessor: no reaper
        return None
    return start_reaper(session_dir)


class RayPlacement(Placement):
    """Rank pools on a Ray cluster (joined, or a local one started here)."""

    def __init__(self, cluster: Any, *, log_dir: str | Path | None = None) -> None:
        ray_environment()
        import ray

        self.cluster = cluster
        # a temporary log directory is removed at close unless an error named a log in it
        self.own_log_dir = log_dir is None
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="geartrain-ranks-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.started = False
        self._reaper: Any = None
        if not ray.is_initialized():
            if cluster.address:
                ray.init(address=cluster.address, log_to_driver=False)
            else:
                # "local": always a new instance, never another job's that happens to run here
                ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False)
                self.started = True
                self._reaper = _start_reaper()
        self.pools: dict[str, RankPool] = {}
        self.groups: list[RayWorkerGroup] = []

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
        name = pool or role
        rank_pool = self.pools.get(name)
        if rank_pool is None:
            rank_pool = self.pools[name] = RankPool(name, world_size, self.cluster, self.log_dir, resources)
        elif rank_pool.size != world_size:
            raise ConfigError(
                [
                    (
                        f"{role}.engine.parallel",
                        f"'{role}' needs {world_size} ranks but shares the {rank_pool.size} ranks of pool '{name}'",
                    )
                ]
            )
        group = RayWorkerGroup(
            rank_pool, role, worker_cls, args, kwargs, seed=seed, balance=self.cluster.balance_tokens
        )
        self.groups.append(group)
        return group

    def close(self, graceful: bool = True) -> None:
        import ray

        for pool in self.pools.values():
            if ray.is_initialized():  # someone may have shut Ray down already: nothing left to stop
                pool.close(graceful=graceful)
        logs_named = any(pool.logs_named for pool in self.pools.values())
        self.pools.clear()
        if self.own_log_dir and not logs_named:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        if self.started and ray.is_initialized():
            ray.shutdown()
            self.started = False
        if self._reaper is not None:
            from geartrain.cluster.ray_reaper import stop_reaper

            stop_reaper(self._reaper)
            self._reaper = None
