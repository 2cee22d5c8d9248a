"""The separate rollout (``rollout.placement = "separate"``): generation on replicas of its
own, weights broadcast after each update, samples streamed up to ``algorithm.max_staleness``
steps ahead of training.

* :class:`RolloutReplica` — one Ray actor holding a whole inference engine (any rollout
  backend, through the same hooks as the colocated one); it generates its data-parallel
  share of each request and records the weight version every sample was generated with.
* :class:`TrainerWorker` — the actor's engine without a rollout. After an update, rank 0
  broadcasts the weights (a snapshot in the rollout's dtype, streamed in
  ``rollout.weight_bucket_bytes`` buckets by :class:`~geartrain.cluster.update_group.UpdateGroup`:
  gloo on CPU, NCCL on GPU) to every replica; a replica applies them between two requests
  (Ray runs an actor's calls one at a time, in the order sent).
* :class:`SeparateGeneration` — the driver's side, in place of
  :class:`~geartrain.trainer.generation.Generation`: it publishes new weights before
  submitting work and keeps the requests of steps ``s .. s + k`` in flight (``k =
  algorithm.max_staleness``), each step's prompts split over the replicas with GRPO groups
  whole. A request for step ``j`` is sent after the weights of update ``j - k - 1`` were,
  so no sample is more than ``k`` versions old when it is trained on (checked on every
  batch: ``staleness`` per sample, ``async/*`` metrics). ``k = 0`` is synchronous and
  reproduces the colocated run's samples and losses exactly.

Checkpoints hold the trainer; requests in flight are not saved: the loader position saved
is the first step not trained yet, so a resumed run regenerates those steps' samples from
the checkpoint's weights (the job says so when it resumes).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from typing import Any

import torch

from geartrain.algorithms import make_actor_loss
from geartrain.batch import Batch
from geartrain.cluster import Dispatch, PendingCall, WorkerGroup
from geartrain.cluster.dispatch import prompt_batch
from geartrain.cluster.update_group import UpdateGroup, free_address
from geartrain.config import EngineConfig, ModelConfig, RolloutConfig
from geartrain.data import PromptBatch, PromptLoader
from geartrain.engine import Engine
from geartrain.errors import GeartrainError
from geartrain.modeling import torch_dtype
from geartrain.rollout import Rollout
from geartrain.trainer.async_rollout import WeightSnapshot
from geartrain.trainer.config import TrainConfig
from geartrain.trainer.generation import Generation
from geartrain.trainer.roles import ActorRolloutWorker, _global_prompt_index, _prompts_and_sampling
from geartrain.types import EngineContext, SamplingParams
from geartrain.weights import BucketStats, drain

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

    def join_update_group(self, address: str, port: int, size: int) -> None:
        """Become member ``1 + rank`` of the weight-update group (member 0: the trainer)."""
        self.group = UpdateGroup(address, port, 1 + self.rank, size, device=self.device)

    def receive_weights(self, version: int) -> dict[str, float]:
        """Take the trainer's broadcast into the engine; its weights are then ``version``."""
        assert self.group is not None, "join_update_group first"
        start = time.perf_counter()
        stats = BucketStats()
        stream = self.group.receive(stats)
        self.rollout.update_weights(stream)
        drain(stream)  # a backend that stopped early: the sender still waits on every bucket
        self.version = version
        return {"timing/weight_receive_s": time.perf_counter() - start, "separate/weight_bytes": float(stats.bytes),
                "separate/weight_buckets": float(stats.num_buckets)}

    def generate(self, prompts: list[list[int]] | Batch, sampling: SamplingParams) -> tuple[Batch, dict[str, float]]:
        """This replica's share of a request, each row with its ``weight_version``."""
        if self.version < 0:
            raise GeartrainError("a separate rollout replica was asked to generate before it received any weights")
        prompts, sampling = _prompts_and_sampling(prompts, sampling)
        start = time.perf_counter()
        batch = _global_prompt_index(self.rollout.generate(prompts, sampling), sampling)
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
            raise GeartrainError(f"rollout replica {self.rank} (weights version {self.version}) differs from the trainer in "
                                 f"{len(differ)} of {len(compared)} tensors compared: {', '.join(differ[:5])}")
        return len(compared)

    def close(self) -> None:
        self.group = None
        self.rollout.shutdown()


# ----------------------------------------------------------------------------- on the trainer


class TrainerWorker(ActorRolloutWorker):
    """The actor's engine with no rollout: it trains, and rank 0 sends the weights."""

    def __init__(
        self, engine: EngineConfig, model: ModelConfig, rollout: RolloutConfig, loss: Any, *,
        free_memory: bool = False, async_rollout: bool = False, ctx: EngineContext,
    ) -> None:
        if free_memory or async_rollout:
            raise GeartrainError("the separate rollout shares nothing with the trainer: free_memory and async_rollout do not apply")
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
        self.group: UpdateGroup | None = None
        self.sending: threading.Thread | None = None
        self.send_error: BaseException | None = None

    def generate(self, prompts: Any, sampling: SamplingParams) -> tuple[Batch, dict[str, float]]:
        raise GeartrainError("rollout.placement = 'separate': the trainer ranks hold no rollout (the replicas generate)")

    def update_group_address(self) -> tuple[str, int]:
        return free_address()

    def join_update_group(self, address: str, port: int, size: int) -> None:
        """Rank 0 becomes member 0 (the sender) of the weight-update group."""
        if self.rank == 0:
            self.group = UpdateGroup(address, port, 0, size, device=self.device)

    def _wait_sent(self) -> None:
        if self.sending is not None:
            self.sending.join()
            self.sending = None
        if self.send_error is not None:
            error, self.send_error = self.send_error, None
            raise GeartrainError(f"the weight broadcast to the rollout replicas failed: {error}") from error

    def broadcast_weights(self) -> dict[str, float]:
        """Snapshot the weights (every rank: sharded engines gather collectively) and send
        them from rank 0 on a thread of its own, so training goes on while the replicas
        finish the requests queued before the update. The previous broadcast is waited for."""
        self._wait_sent()
        snapshot = WeightSnapshot(self.dtype, self.bucket_bytes)
        sync = self.engine.sync_weights(snapshot)
        if self.rank == 0:
            assert self.group is not None, "join_update_group first"
            group = self.group

            def send() -> None:
                try:
                    group.send(iter(snapshot.tensors), self.bucket_bytes)
                except BaseException as exc:  # noqa: BLE001 - reported by the next call
                    self.send_error = exc

            self.sending = threading.Thread(target=send, name="geartrain-weight-broadcast", daemon=True)
            self.sending.start()
        return {"timing/weight_snapshot_s": sync.seconds, "separate/weight_snapshot_bytes": float(sync.bytes)}

    def wait_broadcast(self) -> None:
        """Wait until the last broadcast was sent (and raise what it raised)."""
        self._wait_sent()

    def weight_digests(self) -> dict[str, str]:
        """Digests of the weights as the replicas receive them (rollout dtype)."""
        snapshot = WeightSnapshot(self.dtype, self.bucket_bytes)
        self.engine.sync_weights(snapshot)
        return weight_digests(snapshot.tensors)

    def close(self) -> None:
        if self.sending is not None:
            self.sending.join(timeout=30.0)
        self.group = None


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


class SeparateGeneration(Generation):
    """Rollout batches from the replicas in ``rollout`` (see the module docstring);
    ``actor`` is the trainer's group wrapped in a :class:`VersionedGroup`."""

    def __init__(self, config: TrainConfig, actor: VersionedGroup, rollout: WorkerGroup, tokenizer: Any, loader: PromptLoader) -> None:
        super().__init__(config, actor, tokenizer, loader)
        self.trainer = actor
        self.rollout = rollout
        self.max_staleness = config.algorithm.max_staleness
        self.published = -1
        self.sent = 0  # requests sent to the replicas so far
        self.receiving: deque[tuple[int, PendingCall]] = deque()  # (requests sent before it, call)
        self.in_flight: deque[tuple[int, PendingCall]] = deque()  # (its number, call)
        self.connect()

    def connect(self) -> None:
        """Build the weight-update group: trainer rank 0 and every replica, at once."""
        address, port = self.trainer.call("update_group_address")
        size = 1 + self.rollout.world_size
        joining = [self.trainer.submit("join_update_group", address, port, size),
                   self.rollout.submit("join_update_group", address, port, size)]
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
            # the broadcast fails when a replica died: name the replica (RankFailure) if so
            self.rollout.call("alive")
            raise
        receive = self.rollout.submit("receive_weights", version)
        self.published = version
        if self.max_staleness == 0:
            metrics.update(receive.result())
        else:
            self.receiving.append((self.sent, receive))
        return metrics

    def _send(self, prompts: PromptBatch, sampling: SamplingParams) -> tuple[int, PendingCall]:
        call = self.rollout.submit("generate", prompt_batch(prompts.prompt_ids), sampling, dispatch=Dispatch.DP)
        self.sent += 1
        return self.sent - 1, call

    def _take(self, request: tuple[int, PendingCall], prompts: PromptBatch, n: int) -> tuple[Batch, dict[str, float]]:
        number, pending = request
        start = time.perf_counter()
        batch, metrics = pending.result()
        metrics = {**metrics, "timing/rollout_wait_s": time.perf_counter() - start}
        # broadcasts sent before this request are applied by now (each replica ran them first)
        while self.receiving and self.receiving[0][0] <= number:
            metrics.update(self.receiving.popleft()[1].result())
        versions = torch.tensor(batch["weight_version"], dtype=torch.float32)
        batch["staleness"] = float(self.trainer.version) - versions
        gap = int(batch["staleness"].max()) if len(batch) else 0
        if gap > max(self.max_staleness, 0):
            raise GeartrainError(f"a sample is {gap} weight versions old, more than algorithm.max_staleness = {self.max_staleness}")
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
            return prompts, batch, {**metrics, **more}
        while len(self.ahead) <= self.max_staleness:
            state = self.loader.state_dict()
            prompts = self.loader.next_batch()
            self.in_flight.append(self._send(prompts, self.sampling(step + len(self.ahead))))
            self.ahead.append((prompts, state))
        prompts, _ = self.ahead.popleft()
        batch, more = self._take(self.in_flight.popleft(), prompts, self.config.sampling.n)
        return prompts, batch, {**metrics, **more}

    def check_weights(self) -> int:
        """Compare every replica's weights with the trainer's, bitwise (after the pending
        broadcasts): raises naming the replica and tensors that differ; returns the number
        of tensors compared on each replica (0: the backend does not expose its weights)."""
        self.publish()
        expected = self.trainer.call("weight_digests")
        return self.rollout.call("check_weights", expected)
