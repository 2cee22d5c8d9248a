"""The engine conformance suite on several ranks, through the ``ray`` placement.

A plugin proves its multi-rank behaviour with the same standard tests it passes on one
rank: set ``parallel`` on the suite class::

    from geartrain.testing.engine_suite import EngineConformance

    class TestMyEngineOnTwoRanks(EngineConformance):
        backend = "my-engine"
        parallel = {"dp": 2}          # or {"sp": 2}, {"tp": 2}, {"pp": 2}, ...

Every engine the standard tests build (``make_engine``) is then a :class:`RankedEngine`: a
worker group of ``dp * sp * tp * pp`` Ray ranks (one local Ray instance per test class,
``torch.distributed`` over gloo) each holding the backend's engine, behind the
:class:`~geartrain.engine.Engine` interface. Batches are split by the backend's
``data_parallel_coordinates`` and results gathered back in order, exactly as the trainer
does it, so the test bodies — which compare against a plain transformers model on one
process — hold unchanged: a multi-rank engine must give the one-rank numbers. Weight syncs
stream into a receiver on every rank; rank 0's tensors are handed to the test's receiver.

Needs ``pip install './core[ray]'`` (from the checkout) and ``parallel`` ranks' worth of CPUs (fractions are
fine: ``multirank_cpus_per_rank``).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from geartrain import plugins
from geartrain.batch import Batch
from geartrain.checkpoint import CheckpointManager
from geartrain.cluster import Dispatch, Placement, WorkerGroup
from geartrain.config import EngineConfig, ModelConfig
from geartrain.engine import Engine
from geartrain.rollout import WeightReceiver
from geartrain.types import (
    AdapterReceiver,
    DataParallelCoordinates,
    EngineContext,
    LossFn,
    MemoryStats,
    StepOutput,
    SyncStats,
)

_keys = itertools.count()


class _Receiver:
    """A rank's stand-in for the test's receiver: same dtype and bucket bound; keeps copies."""

    def __init__(self, dtype: torch.dtype, bucket_bytes: int, accepts_adapters: bool = False) -> None:
        self.dtype, self.bucket_bytes = dtype, bucket_bytes
        self.accepts_adapters = accepts_adapters
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self.adapter: tuple[str, dict[str, torch.Tensor], dict[str, Any]] | None = None

    def update_weights(self, named_tensors: Any) -> None:
        for name, tensor in named_tensors:
            self.tensors.append((name, tensor.detach().to("cpu", copy=True)))

    def update_adapter(self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        self.adapter = (name, {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}, config)


class EngineRank:
    """The worker on each rank: one :class:`Engine` of the role the test asked for.

    The worker group gathers each data-parallel slice's outputs from one rank of the slice
    (its first); the contract says every rank of a slice — tensor-, pipeline- or
    sequence-parallel peers, a pipeline's first stage included — returns the same outputs,
    so each rank checks that here, against its peers, before returning."""

    def __init__(self, config: EngineConfig, model: ModelConfig, role: str, *, ctx: EngineContext) -> None:
        ctx.role = role
        self.engine = Engine(config, model, ctx)
        self.rank = ctx.rank
        self.group, self.world_size = ctx.process_group, ctx.world_size

    def forward_backward(self, batch: Batch, loss_fn: LossFn | None, forward_only: bool) -> StepOutput:
        return self._same_as_peers(self.engine.forward_backward(batch, loss_fn, forward_only=forward_only))

    def compute_log_probs(
        self, batch: Batch, entropy: bool, adapters_off: bool = False, sum_pi_squared: bool = False
    ) -> StepOutput:
        out = self.engine.compute_log_probs(
            batch, entropy=entropy, adapters_off=adapters_off, sum_pi_squared=sum_pi_squared
        )
        return self._same_as_peers(out)

    def _same_as_peers(self, out: StepOutput) -> StepOutput:
        """Raise ``AssertionError`` unless every rank of this rank's data-parallel slice
        returned exactly these outputs (collective over the role's ranks)."""
        if self.world_size == 1 or self.group is None:
            return out
        import torch.distributed as dist

        mine = self.engine.dp.rank
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, (mine, out.outputs), group=self.group)
        for peer, (dp_rank, outputs) in enumerate(everyone):
            if dp_rank != mine:
                continue
            if sorted(outputs) != sorted(out.outputs):
                raise AssertionError(
                    f"rank {self.rank} returned outputs {sorted(out.outputs)}, its peer rank {peer} {sorted(outputs)}"
                )
            for key, tensor in out.outputs.items():
                if not torch.equal(tensor, outputs[key]):
                    diff = (
                        (tensor.float() - outputs[key].float()).abs().max()
                        if tensor.shape == outputs[key].shape
                        else "shape"
                    )
                    raise AssertionError(
                        f"'{key}' differs between rank {self.rank} and rank {peer} of the same data-parallel slice "
                        f"({diff}): every rank of a slice must return the same outputs"
                    )
        return out

    def optimizer_step(self) -> dict[str, float]:
        return self.engine.optimizer_step()

    def sync_weights(
        self, dtype: torch.dtype | None, bucket_bytes: int, adapters: bool = False
    ) -> tuple[SyncStats, Any, Any]:
        """The stats, and on rank 0 the tensors and the adapter (``update_adapter``'s
        arguments, when the receiver takes adapters and the engine sent one)."""
        receiver = _Receiver(dtype, bucket_bytes, adapters) if dtype is not None else None
        stats = self.engine.sync_weights(receiver)
        if receiver is None or self.rank != 0:
            return stats, None, None
        return stats, receiver.tensors, receiver.adapter

    def save_checkpoint(self, root: str, keep_last: int, step: int, extra: dict[str, Any]) -> str:
        return str(self.engine.save_checkpoint(CheckpointManager(root, keep_last), step, extra))

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return self.engine.load_checkpoint(path)

    def export_hf(self, path: str, tokenizer: Any | None) -> str:
        return str(self.engine.export_hf(path, tokenizer))

    def offload(self, what: frozenset[str]) -> MemoryStats:
        return self.engine.offload(what)

    def onload(self) -> MemoryStats:
        return self.engine.onload()


class RankedEngine:
    """:class:`~geartrain.engine.Engine`'s interface over a worker group of ranks.

    Engines of one ``pool`` share its rank processes (the conformance suite's engines all
    live in pool ``"conformance"``); engines that must not share processes — e.g. two
    layouts of a backend that keeps its parallel state per process, as megatron-core
    does — are given different pools."""

    def __init__(
        self, placement: Placement, config: EngineConfig, model: ModelConfig, role: str, *, pool: str = "conformance"
    ) -> None:
        self.config, self.model_config = config, model
        self.info = plugins.backend_info("engine", config.backend)
        self.group: WorkerGroup = placement.group(
            f"{role}-{next(_keys)}",
            EngineRank,
            config,
            model,
            role,
            world_size=config.parallel.world_size,
            pool=pool,
        )
        size = getattr(self.group, "dp_size", config.parallel.world_size)
        self.dp = DataParallelCoordinates(rank=0, size=size)

    @property
    def name(self) -> str:
        return self.config.backend

    def forward_backward(
        self, batch: Batch, loss_fn: LossFn | None = None, *, forward_only: bool = False
    ) -> StepOutput:
        return self.group.call("forward_backward", batch, loss_fn, forward_only, dispatch=Dispatch.DP)

    def compute_log_probs(
        self, batch: Batch, *, entropy: bool = False, adapters_off: bool = False, sum_pi_squared: bool = False
    ) -> StepOutput:
        return self.group.call("compute_log_probs", batch, entropy, adapters_off, sum_pi_squared, dispatch=Dispatch.DP)

    def optimizer_step(self) -> dict[str, float]:
        return self.group.call("optimizer_step")

    def sync_weights(self, rollout: WeightReceiver | None) -> SyncStats:
        dtype = rollout.dtype if rollout is not None else None
        bucket = rollout.bucket_bytes if rollout is not None else 64 << 20
        adapters = isinstance(rollout, AdapterReceiver) and rollout.accepts_adapters
        stats, tensors, adapter = self.group.call("sync_weights", dtype, bucket, adapters)
        if rollout is not None:
            if tensors or adapter is None:
                rollout.update_weights(iter(tensors))
            if adapter is not None:
                rollout.update_adapter(*adapter)  # type: ignore[union-attr]
        return stats

    def save_checkpoint(self, manager: CheckpointManager, step: int, extra: dict[str, Any]) -> Path:
        return Path(self.group.call("save_checkpoint", str(manager.root), manager.keep_last, step, extra))

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        return self.group.call("load_checkpoint", str(path))

    def export_hf(self, path: str | Path, tokenizer: Any | None = None) -> Path:
        return Path(self.group.call("export_hf", str(path), tokenizer))

    def offload(self, what: frozenset[str] = frozenset({"params", "grads", "optimizer"})) -> MemoryStats:
        return self.group.call("offload", what)

    def onload(self) -> MemoryStats:
        return self.group.call("onload")

    def close(self) -> None:
        self.group.shutdown()


def start_placement(world_size: int, cpus_per_rank: float) -> Placement:
    """A ``ray`` placement on a local Ray instance for one conformance class."""
    from geartrain.cluster import make_placement
    from geartrain.trainer.config import ClusterConfig, RankResources

    cluster = ClusterConfig(placement="ray", resources_per_rank=RankResources(cpus=cpus_per_rank), balance_tokens=False)
    return make_placement(cluster)
