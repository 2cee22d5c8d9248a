"""The separate rollout (``rollout.placement = "separate"``): generation on replicas of its
own, weights broadcast after each update, samples streamed up to ``algorithm.max_staleness``
steps ahead of training.

* :class:`RolloutReplica` — one Ray actor holding a whole inference engine (any rollout
  backend, through the same hooks as the colocated one); it generates the requests sent
  to it and records the weight version every sample was generated with.
* :class:`TrainerWorker` — the actor's engine without a rollout. After an update, rank 0
  sends the weights (a snapshot in the rollout's dtype, streamed in
  ``rollout.weight_bucket_bytes`` buckets by :class:`~geartrain.cluster.update_group.UpdateGroup`:
  gloo on CPU, NCCL on GPU) to every replica, each over a group of its own, from a send
  queue holding at most ``max_staleness + 1`` snapshots
  (:class:`~geartrain.cluster.send_queue.SendQueue`): one replica's long request holds
  neither the other replicas nor the trainer. A replica applies them between two requests
  (Ray runs an actor's calls one at a time, in the order sent).
* :class:`SeparateGeneration` — the driver's side, in place of
  :class:`~geartrain.trainer.generation.Generation`: it publishes new weights before
  submitting work. ``k = algorithm.max_staleness = 0`` is synchronous (each step's prompts
  split over the replicas, GRPO groups whole) and reproduces the colocated run's samples and
  losses exactly. ``k >= 1`` streams below the step (:mod:`geartrain.trainer.group_queue`):
  loader batches go out ahead, one request per replica's share, each routed to the replica
  that can start it soonest; each step trains the first finished GRPO groups and drops
  those more than ``k`` versions old, so no trained sample is older than that (checked on
  every batch: ``staleness`` per sample, ``async/*`` metrics).

A replica that dies ends the run, naming it, unless ``rollout.replica_restarts`` allows
replacing it (:meth:`SeparateGeneration._replace`: a new replica, update group and weights;
what was in flight on the dead one sent again).

Checkpoints hold the trainer; requests in flight are not saved: the loader position saved
is before the oldest request with groups not trained yet, so a resumed run regenerates those
samples from the checkpoint's weights (the job says so when it resumes).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from geartrain.algorithms import make_actor_loss
from geartrain.batch import Batch
from geartrain.cluster import Dispatch, PendingCall, WorkerGroup
from geartrain.cluster.dispatch import dp_rows, gather, prompt_batch, reduce_metrics, shard_value
from geartrain.cluster.ray_placement import RankFailure
from geartrain.cluster.send_queue import SendQueue
from geartrain.cluster.update_group import UpdateGroup, free_address
from geartrain.config import EngineConfig, ModelConfig, RolloutConfig
from geartrain.data import PromptBatch, PromptLoader
from geartrain.engine import Engine
from geartrain.errors import GeartrainError
from geartrain.layout import READY_AT
from geartrain.modeling import torch_dtype
from geartrain.rollout import Rollout, wait_until
from geartrain.trainer.async_rollout import WeightSnapshot
from geartrain.trainer.config import TrainConfig
from geartrain.trainer.generation import Generation
from geartrain.trainer.group_queue import Group, GroupQueue
from geartrain.trainer.roles import ActorRolloutWorker, _global_prompt_index, _prompts_and_sampling
from geartrain.trainer.sampling import concat_rollouts
from geartrain.types import EngineContext, SamplingParams
from geartrain.weights import BucketStats, drain

logger = logging.getLogger("geartrain.trainer")

#: methods of the actor's group after which its weights differ from the replicas'
UPDATES = frozenset({"update", "update_once", "load_checkpoint"})


def weight_digests(named: Any) -> dict[str, str]:
    """``{name: sha256 of the tensor's dtype, shape and bytes}``: equal digests are
    bitwise-equal weights."""
    out = {}
    for name, tensor in named:
        t = tensor.detach().cpu().contiguous()
        h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()
    return out


# ----------------------------------------------------------------------------- on the replicas


class RolloutReplica:
    """A rollout replica: a whole inference engine in a process of its own."""

    def __init__(self, rollout: RolloutConfig, model: ModelConfig, *, ctx: EngineContext) -> None:
        self.rollout = Rollout(rollout, model, ctx)
        self.rank = ctx.rank
        self.device = ctx.device
        self.version = -1
        """The version of the weights in the engine (-1: not received yet)."""
        self.group: UpdateGroup | None = None

    def join_update_group(self, addresses: list[tuple[str, int]]) -> None:
        """Become member 1 of this replica's weight-update group, ``addresses[rank]``
        (member 0: trainer rank 0; one group per replica, see
        :mod:`geartrain.cluster.send_queue`)."""
        address, port = addresses[self.rank]
        self.group = UpdateGroup(address, port, 1, 2, device=self.device)

    def receive_weights(self, version: int) -> dict[str, float]:
        """Take the trainer's broadcast into the engine; its weights are then ``version``."""
        assert self.group is not None, "join_update_group first"
        start = time.perf_counter()
        stats = BucketStats()
        stream = self.group.receive(stats)
        self.rollout.update_weights(stream)
        drain(stream)  # a backend that stopped early: the sender still waits on every bucket
        self.version = version
        return {
            "timing/weight_receive_s": time.perf_counter() - start,
            "separate/weight_bytes": float(stats.bytes),
            "separate/weight_buckets": float(stats.num_buckets),
        }

    def generate(self, prompts: list[list[int]] | Batch, sampling: SamplingParams) -> tuple[Batch, dict[str, float]]:
        """This replica's share of a request, each row with its ``weight_version``."""
        if self.version < 0:
            raise GeartrainError("a separate rollout replica was asked to generate before it received any weights")
        prompts, sampling = _prompts_and_sampling(prompts, sampling)
        start = time.perf_counter()
        # streamed: a simulated-latency backend's per-row finish times ride along (ready_at)
        batch = _global_prompt_index(self.rollout.generate(prompts, sampling, stream=True), sampling)
        batch.meta["rollout_rank"] = [self.rank] * len(batch)
        batch.meta["weight_version"] = [self.version] * len(batch)
        return batch, {"timing/generate_s": time.perf_counter() - start}

    def alive(self) -> int:
        """Nothing: a call that fails only when this replica is gone."""
        return self.version

    def check_weights(self, expected: dict[str, str]) -> int:
        """Raise unless the engine's weights are bitwise ``expected`` (digests by name, see
        :func:`weight_digests`), where the backend exposes them as a torch module (the torch
        rollout's ``model``). Returns the number of tensors compared (0: not exposed)."""
        model = getattr(self.rollout.handle, "model", None)
        if not isinstance(model, torch.nn.Module):
            return 0
        have = weight_digests(model.state_dict().items())
        compared = [name for name in expected if name in have]
        differ = sorted(name for name in compared if have[name] != expected[name])
        if differ or not compared:
            raise GeartrainError(
                f"rollout replica {self.rank} (weights version {self.version}) differs from the trainer in "
                f"{len(differ)} of {len(compared)} tensors compared: {', '.join(differ[:5])}"
            )
        return len(compared)

    def close(self) -> None:
        self.group = None
        self.rollout.shutdown()


# ----------------------------------------------------------------------------- on the trainer


class TrainerWorker(ActorRolloutWorker):
    """The actor's engine with no rollout: it trains, and rank 0 sends the weights."""

    def __init__(
        self,
        engine: EngineConfig,
        model: ModelConfig,
        rollout: RolloutConfig,
        loss: Any,
        *,
        free_memory: bool = False,
        async_rollout: bool = False,
        ctx: EngineContext,
    ) -> None:
        if free_memory or async_rollout:
            raise GeartrainError(
                "the separate rollout shares nothing with the trainer: free_memory and async_rollout do not apply"
            )
        self.engine = Engine(engine, model, ctx)
        self.rollout = None  # type: ignore[assignment]
        self.loss_fn = make_actor_loss(loss)
        self.rank = ctx.rank
        self.free_memory = False
        self.device = ctx.device
        self.rollout_released = False
        self.weights_stale = False
        self.version = 0
        self.queue = None
        self.pending = deque()
        self.dtype = torch_dtype(rollout.dtype)
        self.bucket_bytes = rollout.weight_bucket_bytes
        self.groups: list[UpdateGroup] = []
        self.sends: SendQueue | None = None

    def generate(self, prompts: Any, sampling: SamplingParams) -> tuple[Batch, dict[str, float]]:
        raise GeartrainError(
            "rollout.placement = 'separate': the trainer ranks hold no rollout (the replicas generate)"
        )

    def update_group_addresses(self, replicas: int) -> list[tuple[str, int]]:
        """One rendezvous address per replica's update group (hosted by rank 0)."""
        return [free_address() for _ in range(replicas)]

    def join_update_groups(self, addresses: list[tuple[str, int]], max_in_flight: int) -> None:
        """Rank 0 becomes member 0 (the sender) of each replica's update group, in the
        order of ``addresses`` (replica ``r`` joins ``addresses[r]`` at the same time), and
        starts the send queue: at most ``max_in_flight`` snapshots on their way."""
        if self.rank != 0:
            return
        self.groups = [UpdateGroup(address, port, 0, 2, device=self.device) for address, port in addresses]
        self.sends = SendQueue([self._sender(g) for g in self.groups], max_in_flight)

    def _sender(self, group: UpdateGroup) -> Any:
        return lambda tensors: group.send(iter(tensors), self.bucket_bytes)

    def rejoin_update_group(self, replica: int, addresses: list[tuple[str, int]]) -> None:
        """Rank 0: a new update group with the replica started in place of replica
        ``replica`` (which joins ``addresses[replica]`` at the same time); the send queue
        sends to it from now on, and drops what it had not delivered to the dead one."""
        if self.rank != 0:
            return
        assert self.sends is not None, "join_update_groups first"
        address, port = addresses[replica]
        self.groups[replica] = UpdateGroup(address, port, 0, 2, device=self.device)
        self.sends.replace(replica, self._sender(self.groups[replica]))

    def broadcast_weights(self, to: list[int] | None = None) -> dict[str, float]:
        """Snapshot the weights (every rank: sharded engines gather collectively) and queue
        them on rank 0 for every replica, or the replicas ``to`` (a replica started in place
        of a dead one) (:class:`~geartrain.cluster.send_queue.SendQueue`: each replica takes
        them between two of its requests, on its own group, while training goes on). Blocks
        only while ``max_in_flight`` earlier snapshots are undelivered; raises if an earlier
        send failed."""
        snapshot = WeightSnapshot(self.dtype, self.bucket_bytes)
        sync = self.engine.sync_weights(snapshot)
        metrics = {"timing/weight_snapshot_s": sync.seconds, "separate/weight_snapshot_bytes": float(sync.bytes)}
        if self.rank == 0:
            assert self.sends is not None, "join_update_groups first"
            start = time.perf_counter()
            try:
                metrics["separate/snapshots_in_flight"] = float(self.sends.put(snapshot.tensors, to=to))
            except RuntimeError as exc:
                raise GeartrainError(f"the weight broadcast to the rollout replicas failed: {exc}") from exc
            metrics["timing/weight_queue_wait_s"] = time.perf_counter() - start
        return metrics

    def wait_broadcast(self) -> None:
        """Wait until every queued snapshot was delivered (and raise what a send raised)."""
        if self.sends is not None:
            try:
                self.sends.wait()
            except RuntimeError as exc:
                raise GeartrainError(f"the weight broadcast to the rollout replicas failed: {exc}") from exc

    def weight_digests(self) -> dict[str, str]:
        """Digests of the weights as the replicas receive them (rollout dtype)."""
        snapshot = WeightSnapshot(self.dtype, self.bucket_bytes)
        self.engine.sync_weights(snapshot)
        return weight_digests(snapshot.tensors)

    def close(self) -> None:
        if self.sends is not None:
            self.sends.close()
        self.groups = []


# ----------------------------------------------------------------------------- the driver


class VersionedGroup(WorkerGroup):
    """The actor's group, counting the calls that change its weights (``version``)."""

    def __init__(self, inner: WorkerGroup) -> None:
        self.inner = inner
        self.role, self.world_size = inner.role, inner.world_size
        self.version = 0

    def call(self, method: str, *args: Any, dispatch: Dispatch = Dispatch.ALL, **kwargs: Any) -> Any:
        out = self.inner.call(method, *args, dispatch=dispatch, **kwargs)
        if method in UPDATES:
            self.version += 1
        return out

    def submit(self, method: str, *args: Any, dispatch: Dispatch = Dispatch.ALL, **kwargs: Any) -> PendingCall:
        if method in UPDATES:
            raise GeartrainError(f"{method} changes the weights: call it, do not submit it")
        return self.inner.submit(method, *args, dispatch=dispatch, **kwargs)

    def shutdown(self) -> None:
        self.inner.shutdown()


@dataclass(kw_only=True)
class _Request:
    """A streamed request: one replica's share of a loader batch."""

    number: int
    replica: int
    prompts: PromptBatch
    call: PendingCall
    publishes: int
    """Weight versions sent before it."""
    ready: float | None = None
    """When its last group finishes (known once it is back)."""
    request: Batch | None = None
    sampling: SamplingParams | None = None
    """What was sent (sent again to a replica started in place of a dead one)."""


class SeparateGeneration(Generation):
    """Rollout batches from the replicas in ``rollout`` (see the module docstring);
    ``actor`` is the trainer's group wrapped in a :class:`VersionedGroup`."""

    def __init__(
        self, config: TrainConfig, actor: VersionedGroup, rollout: WorkerGroup, tokenizer: Any, loader: PromptLoader
    ) -> None:
        super().__init__(config, actor, tokenizer, loader)
        self.trainer = actor
        self.rollout = rollout
        self.max_staleness = config.algorithm.max_staleness
        self.balance = config.cluster.balance_tokens
        self.restarts_allowed = config.rollout.replica_restarts
        self.restarts = 0  # dead replicas replaced so far
        self.published = -1
        self.sent = 0  # requests sent to the replicas so far
        # per replica, the weight loads not waited for yet: (requests sent before it, call)
        self.receiving: list[deque[tuple[int, PendingCall]]] = [deque() for _ in range(rollout.world_size)]
        # streaming (max_staleness >= 1): requests not back yet, the groups, and each replica's load
        self.unresolved: deque[_Request] = deque()
        self.queue: GroupQueue | None = None
        self.first_step: int | None = None
        self.streamed = 0  # loader batches streamed so far (each seeded by first_step + its number)
        self.publishes = 0  # weight versions sent so far
        self.routed: list[list[_Request]] = [[] for _ in range(rollout.world_size)]
        self.batch_of: dict[int, int] = {}  # request number -> the loader batch it is a share of
        self.connect()

    def connect(self) -> None:
        """Build one weight-update group per replica (trainer rank 0 and the replica)."""
        addresses = self.trainer.call("update_group_addresses", self.rollout.world_size)
        joining = [
            self.trainer.submit("join_update_groups", addresses, self.max_staleness + 1),
            self.rollout.submit("join_update_group", addresses),
        ]
        for pending in joining:
            pending.result()

    def publish(self) -> dict[str, float]:
        """Send the trainer's weights to the replicas if they changed since the last
        broadcast. Synchronous (``max_staleness = 0``): wait until the replicas applied
        them. Otherwise the replicas apply them after the requests already sent."""
        version = self.trainer.version
        if version == self.published:
            return {}
        try:
            metrics = self.trainer.call("broadcast_weights")
        except GeartrainError:
            # the broadcast fails when a replica died: replace it and send again, or name it (RankFailure)
            if not self._replace_dead():
                raise
            metrics = self.trainer.call("broadcast_weights")
        self.published = version
        self.publishes += 1
        if self.max_staleness == 0:
            replicas = range(self.rollout.world_size)
            loads = [self.rollout.submit_rank(r, "receive_weights", version) for r in replicas]
            metrics.update(reduce_metrics([self._answer(r, loads[r]) for r in replicas]))
        else:  # each replica loads them after its requests already sent, on its own
            for r in range(self.rollout.world_size):
                self.receiving[r].append((self.sent, self.rollout.submit_rank(r, "receive_weights", version)))
        return metrics

    def _send(self, prompts: PromptBatch, sampling: SamplingParams) -> tuple[int, PendingCall]:
        """Send ``prompts`` split over the replicas as ``Dispatch.DP`` splits them (a
        prompt's samples on one replica), one call per replica, so that the share of a
        replica that dies can be sent again to the one started in its place."""
        request = prompt_batch(prompts.prompt_ids)
        replicas = range(self.rollout.world_size)
        rows = dp_rows(request, len(replicas), balance=self.balance)
        shares = [shard_value(request, rows[r]) for r in replicas]

        def send(r: int) -> PendingCall:
            return self.rollout.submit_rank(r, "generate", shares[r], sampling)

        calls = [send(r) for r in replicas]

        def wait() -> Any:
            results = [self._answer(r, calls[r], lambda r=r: send(r)) for r in replicas]
            return gather(results, [rows[r][0] for r in replicas], len(request))

        self.sent += 1
        return self.sent - 1, PendingCall(wait=wait)

    def _answer(self, replica: int, call: PendingCall, resend: Callable[[], PendingCall] | None = None) -> Any:
        """The result of ``call``, sent to ``replica`` alone. If the replica died and
        ``rollout.replica_restarts`` allows, a new one takes its place (:meth:`_replace`)
        and gets the call again by ``resend`` (a weight load, without ``resend``: the new
        replica's load of the same weights stands for it)."""
        while True:
            try:
                return call.result()
            except RankFailure as failure:
                load = self._replace(replica, failure)
                if resend is None:
                    return load
                call = resend()

    def _replace(self, replica: int, failure: RankFailure, *first: _Request) -> dict[str, float]:
        """Start a new replica in place of ``replica``, which died (``failure``), with a
        new update group and the trainer's weights (its version: what the dead replica
        would have had at ``max_staleness = 0``); returns the metrics of that weight load.
        Raises ``failure`` if it is not a death of ``replica`` or no restart is left.
        Streaming: the requests not back yet from the dead replica (``first``, then the
        unresolved ones) are sent again to the new one (:meth:`_resend`)."""
        died = failure.died and failure.rank == replica and failure.role == self.rollout.role
        if not died or self.restarts >= self.restarts_allowed:
            if died and self.restarts_allowed:
                failure.add_note(
                    f"(rollout.replica_restarts = {self.restarts_allowed}: no restart left, "
                    f"{self.restarts} dead replica(s) replaced already)"
                )
            raise failure
        self.restarts += 1
        logger.warning(
            "rollout replica %d died (%s); starting a new one in its place (rollout.replica_restarts: %d left)",
            replica,
            str(failure).splitlines()[0],
            self.restarts_allowed - self.restarts,
        )
        self.rollout.replace_rank(replica)
        addresses = self.trainer.call("update_group_addresses", self.rollout.world_size)
        joining = [
            self.trainer.submit("rejoin_update_group", replica, addresses),
            self.rollout.submit_rank(replica, "join_update_group", addresses),
        ]
        for pending in joining:
            pending.result()
        self.trainer.call("broadcast_weights", [replica])
        load = self.rollout.submit_rank(replica, "receive_weights", self.trainer.version).result()
        self._resend(replica, *first)
        return load

    def _resend(self, replica: int, *first: _Request) -> None:
        """After ``replica`` was replaced: its weight loads not waited for are void (the new
        replica has the newest weights) and its streamed requests not back yet (``first``,
        then the unresolved ones, in order) go to the new replica."""
        self.receiving[replica].clear()
        for request in [*first, *self.unresolved]:
            if request.replica == replica:
                request.call = self.rollout.submit_rank(replica, "generate", request.request, request.sampling)
                request.publishes = self.publishes

    def _replace_dead(self) -> bool:
        """Ask every replica whether it is alive (after the calls already sent to it) and
        replace those that died (:meth:`_replace`; raising the death where no restart is
        left). Whether any was replaced."""
        probes = [self.rollout.submit_rank(r, "alive") for r in range(self.rollout.world_size)]
        replaced = False
        for r, probe in enumerate(probes):
            try:
                probe.result()
            except RankFailure as failure:
                self._replace(r, failure)
                replaced = True
        return replaced

    def _result(
        self, request: tuple[int, PendingCall], replica: int | None = None
    ) -> tuple[Batch, list[float] | None, dict[str, float]]:
        """A sent request's samples (on ``replica``, or split over all), their ``ready_at``
        (simulated latency; ``None``: ready now) and the replicas' metrics, with those of
        the weight loads applied before it."""
        number, pending = request
        batch, metrics = pending.result()
        # weight loads sent before this request are applied by now (each replica ran them first)
        for r in range(len(self.receiving)) if replica is None else [replica]:
            while self.receiving[r] and self.receiving[r][0][0] <= number:
                metrics.update(self._answer(r, self.receiving[r].popleft()[1]))
        return batch, batch.meta.pop(READY_AT, None), metrics

    def _stamp(self, batch: Batch) -> None:
        """Each sample's ``staleness`` (trainer version minus its weights'), checked
        against ``algorithm.max_staleness``."""
        versions = torch.tensor(batch["weight_version"], dtype=torch.float32)
        batch["staleness"] = float(self.trainer.version) - versions
        gap = int(batch["staleness"].max()) if len(batch) else 0
        if gap > max(self.max_staleness, 0):
            raise GeartrainError(
                f"a sample is {gap} weight versions old, more than algorithm.max_staleness = {self.max_staleness}"
            )

    def _take(self, request: tuple[int, PendingCall], prompts: PromptBatch, n: int) -> tuple[Batch, dict[str, float]]:
        start = time.perf_counter()
        batch, ready_at, metrics = self._result(request)
        if ready_at:
            wait_until(max(ready_at))  # a whole request: as long as its longest sample
        metrics = {**metrics, "timing/rollout_wait_s": time.perf_counter() - start}
        self._stamp(batch)
        return self.annotate(batch, prompts, n), metrics

    def generate(self, prompts: PromptBatch, sampling: SamplingParams) -> tuple[Batch, dict[str, float]]:
        """Samples of ``prompts`` now (validation, baselines, dynamic sampling's rounds),
        with the newest weights (after the requests already in flight)."""
        metrics = self.publish()
        batch, more = self._take(self._send(prompts, sampling), prompts, sampling.n)
        return batch, {**metrics, **more}

    def next(self, step: int) -> tuple[PromptBatch, Batch, dict[str, float]]:
        """Step ``step``'s prompts and samples: publish the newest weights, keep the
        requests of steps ``step .. step + max_staleness`` in flight, take this step's."""
        metrics = self.publish()
        if self.max_staleness == 0:
            prompts = self.loader.next_batch()
            batch, more = self.generate(prompts, self.sampling(step))
            metrics = {**metrics, **more}
        else:
            prompts, batch, metrics = self._stream(step, metrics)
        if self.restarts_allowed:
            metrics["separate/replica_restarts"] = float(self.restarts)
        return prompts, batch, metrics

    # ------------------------------------------------------------------ streaming (k >= 1)
    def loader_state(self) -> dict[str, Any]:
        """Before the prompts of the oldest request with groups not trained yet."""
        state = self.queue.loader_state() if self.queue is not None else None
        return state if state is not None else self.loader.state_dict()

    def _available(self, replica: int, now: float) -> float:
        """When ``replica`` can start a request sent now: after the weights it was sent
        last are loaded, i.e. once the requests sent to it before them are done (unknown,
        so never, while one is not back)."""
        sent = self.routed[replica] = [q for q in self.routed[replica] if q.ready is None or q.ready > now]
        before = [q for q in sent if q.publishes < self.publishes]
        if any(q.ready is None for q in before):
            return float("inf")
        return max([now, *(q.ready for q in before if q.ready is not None)])

    def _send_request(self) -> None:
        """Send the loader's next batch (seeded by its own number), split in one request
        per replica's share, each to the replica that can start it soonest (a replica
        whose weight load waits for a long sample is passed over)."""
        assert self.queue is not None and self.first_step is not None
        state = self.loader.state_dict()
        prompts = self.loader.next_batch()
        sampling = self.sampling(self.first_step + self.streamed)
        self.streamed += 1
        replicas = self.rollout.world_size
        share = -(-len(prompts) // replicas)
        for lo in range(0, len(prompts), share):
            part = PromptBatch(
                rows=prompts.rows[lo : lo + share], indices=prompts.indices[lo : lo + share], epoch=prompts.epoch
            )
            request = prompt_batch(part.prompt_ids)
            request.meta["prompt_index"] = list(range(lo, lo + len(part)))  # samples as if sent whole
            now = time.time()
            replica = min(range(replicas), key=lambda r: (self._available(r, now), self._groups_on(r), r))
            call = self.rollout.submit_rank(replica, "generate", request, sampling)
            sent = _Request(
                number=self.sent,
                replica=replica,
                prompts=part,
                call=call,
                publishes=self.publishes,
                request=request,
                sampling=sampling,
            )
            self.sent += 1
            self.queue.sent(sent.number, part, state)
            self.batch_of[sent.number] = self.streamed - 1
            self.unresolved.append(sent)
            self.routed[replica].append(sent)

    def _groups_on(self, replica: int) -> int:
        assert self.queue is not None
        return sum(len(q.prompts) for q in self.routed[replica] if q.number in self.queue.requests)

    def _resolve(self, metrics: dict[str, float]) -> None:
        """Wait for the oldest unresolved request and queue its groups."""
        assert self.queue is not None
        request = self.unresolved.popleft()
        number, prompts = request.number, request.prompts
        while True:
            try:
                batch, ready_at, more = self._result((number, request.call), request.replica)
                break
            except RankFailure as failure:  # the replica died: a new one, this request sent again
                self._replace(request.replica, failure, request)
        arrived = time.time()
        more["separate/replica_generate_s"] = more.pop("timing/generate_s", 0.0)  # the step's generate_s is its wait
        metrics.update(more)
        n = self.config.sampling.n
        batch = self.annotate(batch, prompts, n)
        groups = []
        for i in range(len(prompts)):
            rows = list(range(i * n, (i + 1) * n))
            one = PromptBatch(rows=[prompts.rows[i]], indices=[prompts.indices[i]], epoch=prompts.epoch)
            ready = max(ready_at[r] for r in rows) if ready_at else arrived
            groups.append(
                Group(
                    request=number,
                    index=i,
                    prompt=one,
                    rows=batch.index(rows),
                    version=int(batch["weight_version"][rows[0]]),
                    ready_at=ready,
                )
            )
        request.ready = max((g.ready_at for g in groups), default=arrived)
        self.queue.add(groups)

    def _stream(self, step: int, metrics: dict[str, float]) -> tuple[PromptBatch, Batch, dict[str, float]]:
        """The first ``batch_size`` finished groups no more than ``max_staleness`` versions
        old (see :mod:`geartrain.trainer.group_queue`), the pipeline kept full."""
        if self.queue is None:
            groups = self.config.data.batch_size
            self.queue = GroupQueue(
                batch_groups=groups, max_staleness=self.max_staleness, capacity=(self.max_staleness + 1) * groups
            )
            self.first_step = step
        queue, version, start = self.queue, self.trainer.version, time.perf_counter()
        while queue.has_room(queue.batch_groups):
            self._send_request()
        dropped = queue.dropped
        while True:
            queue.drop_stale(version)
            first = queue.first_finished()
            enough = len(first) == queue.batch_groups
            if enough and (not self.unresolved or first[-1].ready_at <= time.time()):
                break  # a request not back yet cannot finish before now
            if self.unresolved:
                self._resolve(metrics)
            elif enough:
                break
            else:  # what is left in flight was too stale: more work
                self._send_request()
        taken = queue.take(version)
        wait_until(max(g.ready_at for g in taken))
        wait = time.perf_counter() - start
        batch = concat_rollouts([g.rows for g in taken])
        self._stamp(batch)
        prompts = PromptBatch(
            rows=[g.prompt.rows[0] for g in taken],
            indices=[g.prompt.indices[0] for g in taken],
            epoch=taken[0].prompt.epoch,
        )
        metrics.update(
            {
                "timing/rollout_wait_s": wait,
                "timing/generate_s": wait,
                "async/dropped_groups": float(queue.dropped - dropped),
                "async/queued_groups": float(len(queue.finished)),
                "async/loader_batches": float(len({self.batch_of[g.request] for g in taken})),
            }
        )
        self.batch_of = {n: b for n, b in self.batch_of.items() if n in queue.requests}
        return prompts, batch, metrics

    def check_weights(self) -> int:
        """Compare every replica's weights with the trainer's, bitwise (after the pending
        broadcasts): raises naming the replica and tensors that differ; returns the number
        of tensors compared on each replica (0: the backend does not expose its weights)."""
        self.publish()
        expected = self.trainer.call("weight_digests")
        replicas = range(self.rollout.world_size)

        def check(r: int) -> PendingCall:
            return self.rollout.submit_rank(r, "check_weights", expected)

        calls = [check(r) for r in replicas]
        return min(self._answer(r, calls[r], lambda r=r: check(r)) for r in replicas)
