"""Recording fakes of an engine and a rollout, for testing the core's own plumbing.

They are fakes, not backends: no transformer runs. A :class:`FakeBackends` registers an
engine and a rollout (both named ``"fake"`` unless told otherwise) through the public
registration API, and every hook call of every role lands, in order, in one list of
:class:`FakeCall` records: which role, which hook, which batch keys and how many rows. So a
test of the trainer can assert the data flow (what each role received), the order of the
calls (the hybrid switch) and the numbers that come back, without a model in the way.

The fake engine's "model" is one scalar parameter ``theta`` per role. Its per-token outputs
follow the layout contract and are simple closed forms of the batch (so a test can compute
them by hand): on every position ``t`` that has a context (``attention_mask[t]`` and
``attention_mask[t-1]``), ``log_probs = -theta - 0.01 * (input_ids % 10)``, ``entropy = 1``
and, for value models, ``values = 0.1 * t``; 0 elsewhere. Training calls the ``loss_fn`` on
one micro-batch, backpropagates into ``theta`` and steps with :mod:`geartrain.optim`.
:class:`RecordingWorkerGroup` wraps a real worker group to record how the trainer calls
each role (method and dispatch). The fake rollout samples response ``j`` of prompt ``i`` as the tokens
``FIRST_TOKEN + (i + j + k) % 10`` for ``k < 1 + (i + j) % max_tokens``, each with log-prob
``-0.5``, and reports how many weight syncs it received.

Use::

    fakes = FakeBackends()
    with fakes.registered():
        ... EngineConfig(backend="fake") ... RolloutConfig(backend="fake") ...
    fakes.hooks("actor")  # ["build_model", "shard", "reshard_for_rollout", ...]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from geartrain import plugins
from geartrain.batch import Batch
from geartrain.checkpoint import load_state, save_state
from geartrain.cluster import Dispatch, WorkerGroup
from geartrain.config import EngineConfig, ModelConfig, RolloutConfig
from geartrain.hookspecs import hookimpl
from geartrain.layout import check_generate_inputs, rollout_batch
from geartrain.optim import build_optimizer, clipped_step, load_scheduler_state
from geartrain.types import (
    Capability,
    EngineContext,
    LossContext,
    LossFn,
    MemoryStats,
    SamplingParams,
    StepOutput,
    SyncStats,
    WeightReceiver,
)
from geartrain.weights import send_weights

__all__ = [
    "FIRST_TOKEN",
    "FakeBackends",
    "FakeCall",
    "FakeModel",
    "FakeRolloutHandle",
    "GroupCall",
    "RecordingWorkerGroup",
    "write_fake_job",
]

#: The fake rollout's smallest sampled token id ("0" in the tiny character tokenizer).
FIRST_TOKEN = 20


@dataclass(frozen=True, slots=True)
class FakeCall:
    """One hook call: the role whose instance received it, the hook, the batch's tensor
    and meta keys at the time of the call (empty when the hook takes no batch), its rows,
    hook details, and the batch itself (tensors may be read; later keys may have been added)."""

    role: str
    hook: str
    keys: frozenset[str] = frozenset()
    rows: int = 0
    detail: dict[str, Any] = field(default_factory=dict, compare=False)
    batch: Batch | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class GroupCall:
    """One call through a worker group: role, method and how it was dispatched."""

    role: str
    method: str
    dispatch: Dispatch


class RecordingWorkerGroup(WorkerGroup):
    """Wraps a real worker group and records each call (role, method, dispatch) into
    ``log`` before passing it on unchanged."""

    def __init__(self, inner: WorkerGroup, log: list[GroupCall]) -> None:
        self.inner = inner
        self.role = inner.role
        self.world_size = inner.world_size
        self.log = log

    def call(self, method: str, *args: Any, dispatch: Dispatch = Dispatch.ALL, **kwargs: Any) -> Any:
        self.log.append(GroupCall(role=self.role, method=method, dispatch=dispatch))
        return self.inner.call(method, *args, dispatch=dispatch, **kwargs)

    def shutdown(self) -> None:
        self.inner.shutdown()


@dataclass(kw_only=True)
class FakeModel:
    """The fake engine's handle."""

    module: torch.nn.Module
    config: EngineConfig
    ctx: EngineContext
    value_head: bool
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None

    @property
    def theta(self) -> torch.nn.Parameter:
        return self.module.theta  # type: ignore[return-value]


@dataclass(kw_only=True)
class FakeRolloutHandle:
    """The fake rollout's handle."""

    ctx: EngineContext
    config: RolloutConfig
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    syncs: int = 0
    released: bool = False


def _keys(batch: Batch) -> frozenset[str]:
    return frozenset(batch.tensor_keys()) | frozenset(batch.meta)


def fake_outputs(model: FakeModel, batch: Batch, need_entropy: bool) -> dict[str, torch.Tensor]:
    """The fake engine's per-token outputs (closed forms given in the module docstring)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    valid = torch.zeros_like(mask, dtype=torch.bool)
    valid[:, 1:] = mask[:, 1:].bool() & mask[:, :-1].bool()
    if model.value_head:
        positions = torch.arange(ids.shape[1], dtype=torch.float32).expand(ids.shape)
        return {"values": torch.where(valid, 0.1 * positions + 0 * model.theta, 0.0)}
    out = {"log_probs": torch.where(valid, -model.theta - 0.01 * (ids % 10).float(), 0.0)}
    if need_entropy:
        out["entropy"] = valid.float()
    return out


class _FakeEngine:
    """The fake engine's hook implementations (one object; handles carry the role)."""

    def __init__(self, owner: FakeBackends) -> None:
        self.owner = owner

    @hookimpl
    def capabilities(self) -> list[str]:
        return [Capability.CPU, Capability.VALUE_HEAD, Capability.OFFLOAD]

    @hookimpl
    def build_model(self, config: ModelConfig, ctx: EngineContext) -> torch.nn.Module:
        self.owner.record(ctx.role, "build_model", value_head=config.value_head)
        module = torch.nn.Module()
        module.theta = torch.nn.Parameter(torch.tensor(0.5))
        return module

    @hookimpl
    def shard(
        self, module: torch.nn.Module, config: EngineConfig, model_config: ModelConfig, ctx: EngineContext
    ) -> FakeModel:
        self.owner.record(ctx.role, "shard", lr=config.optim.lr)
        model = FakeModel(module=module, config=config, ctx=ctx, value_head=model_config.value_head)
        if config.optim.lr > 0:
            model.optimizer, model.scheduler = build_optimizer(module.parameters(), config.optim)
        return model

    @hookimpl
    def forward_backward(
        self, model: FakeModel, batch: Batch, loss_fn: LossFn | None, forward_only: bool
    ) -> StepOutput:
        need_entropy = bool(batch.info.get("need_entropy", False))
        self.owner.record(
            model.ctx.role,
            "forward_backward",
            batch,
            forward_only=forward_only,
            loss=loss_fn is not None,
            need_entropy=need_entropy,
        )
        with torch.set_grad_enabled(not forward_only):
            outputs = fake_outputs(model, batch, need_entropy)
            metrics: dict[str, float] = {}
            if loss_fn is not None:
                ctx = LossContext(global_tokens=int(batch["loss_mask"].sum()), global_sequences=len(batch))
                loss, loss_metrics = loss_fn(outputs, batch, ctx)
                if not forward_only:
                    loss.backward()
                metrics = {k: float(v) for k, v in loss_metrics.items()}
        metrics["tokens"] = float(batch["attention_mask"].sum())
        return StepOutput(outputs={k: v.detach() for k, v in outputs.items()}, metrics=metrics)

    @hookimpl
    def optimizer_step(self, model: FakeModel) -> dict[str, float]:
        self.owner.record(model.ctx.role, "optimizer_step")
        if model.optimizer is None:
            raise RuntimeError(f"fake engine: role {model.ctx.role} has no optimizer (lr=0)")
        return clipped_step(
            model.module.parameters(), model.optimizer, model.scheduler, model.config.optim.clip_grad
        ).metrics()

    @hookimpl
    def reshard_for_rollout(self, model: FakeModel, rollout: WeightReceiver | None) -> SyncStats:
        self.owner.record(model.ctx.role, "reshard_for_rollout", theta=float(model.theta.detach()))
        return send_weights(model.module.state_dict(keep_vars=True).items(), rollout)

    @hookimpl
    def save_checkpoint(self, model: FakeModel, path: Path, extra: dict[str, Any]) -> None:
        self.owner.record(model.ctx.role, "save_checkpoint")
        state = {"theta": model.theta.detach().clone(), "extra": extra}
        if model.optimizer is not None:
            state |= {"optimizer": model.optimizer.state_dict(), "scheduler": model.scheduler.state_dict()}
        save_state(state, Path(path) / "fake.pt")

    @hookimpl
    def load_checkpoint(self, model: FakeModel, path: Path) -> dict[str, Any]:
        self.owner.record(model.ctx.role, "load_checkpoint")
        state = load_state(Path(path) / "fake.pt")
        with torch.no_grad():
            model.theta.copy_(state["theta"])
        if model.optimizer is not None and "optimizer" in state:
            model.optimizer.load_state_dict(state["optimizer"])
            load_scheduler_state(model.scheduler, state["scheduler"])
        return state["extra"]

    @hookimpl
    def offload(self, model: FakeModel, what: frozenset[str]) -> MemoryStats:
        self.owner.record(model.ctx.role, "offload", what=sorted(what))
        return MemoryStats(before=0, after=0, seconds=0.0)

    @hookimpl
    def onload(self, model: FakeModel) -> MemoryStats:
        self.owner.record(model.ctx.role, "onload")
        return MemoryStats(before=0, after=0, seconds=0.0)


class _FakeRollout:
    """The fake rollout's hook implementations."""

    def __init__(self, owner: FakeBackends) -> None:
        self.owner = owner

    @hookimpl
    def capabilities(self) -> list[str]:
        return [Capability.CPU, Capability.RELEASE_MEMORY]

    @hookimpl
    def build_rollout(self, config: RolloutConfig, model: ModelConfig, ctx: EngineContext) -> FakeRolloutHandle:
        self.owner.record(ctx.role, "build_rollout")
        return FakeRolloutHandle(ctx=ctx, config=config)

    @hookimpl
    def update_weights(self, rollout: FakeRolloutHandle, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        received = dict(named_tensors)
        rollout.weights.update(received)
        rollout.syncs += 1
        self.owner.record(rollout.ctx.role, "update_weights", names=sorted(received))

    @hookimpl
    def generate(self, rollout: FakeRolloutHandle, prompts: list[list[int]], sampling: SamplingParams) -> Batch:
        self.owner.record(rollout.ctx.role, "generate", prompts=len(prompts), n=sampling.n, seed=sampling.seed)
        if rollout.released:
            raise RuntimeError("fake rollout: generate while released")
        check_generate_inputs("fake", prompts, sampling, max_model_len=rollout.config.max_model_len)
        rows = [(i, j) for i in range(len(prompts)) for j in range(sampling.n)]
        responses = [
            [FIRST_TOKEN + (i + j + k) % 10 for k in range(1 + (i + j) % sampling.max_tokens)] for i, j in rows
        ]
        return rollout_batch(
            [prompts[i] for i, _ in rows],
            responses,
            [[-0.5] * len(r) for r in responses],
            prompt_index=[i for i, _ in rows],
            finish_reason=["length" if len(r) == sampling.max_tokens else "stop" for r in responses],
            pad_token_id=0,
        )

    @hookimpl
    def release(self, rollout: FakeRolloutHandle) -> MemoryStats:
        self.owner.record(rollout.ctx.role, "release")
        rollout.released = True
        return MemoryStats(before=0, after=0, seconds=0.0)

    @hookimpl
    def resume(self, rollout: FakeRolloutHandle) -> MemoryStats:
        self.owner.record(rollout.ctx.role, "resume")
        rollout.released = False
        return MemoryStats(before=0, after=0, seconds=0.0)

    @hookimpl
    def shutdown(self, rollout: FakeRolloutHandle) -> None:
        self.owner.record(rollout.ctx.role, "shutdown")


class FakeBackends:
    """A recording fake engine and rollout, and the log of every hook call they got."""

    def __init__(self, engine_name: str = "fake", rollout_name: str = "fake") -> None:
        self.engine_name = engine_name
        self.rollout_name = rollout_name
        self.calls: list[FakeCall] = []
        self.engine_plugin = _FakeEngine(self)
        self.rollout_plugin = _FakeRollout(self)

    def record(self, role: str, hook: str, batch: Batch | None = None, **detail: Any) -> None:
        if batch is None:
            self.calls.append(FakeCall(role=role, hook=hook, detail=detail))
        else:
            self.calls.append(
                FakeCall(role=role, hook=hook, keys=_keys(batch), rows=len(batch), detail=detail, batch=batch)
            )

    def register(self) -> None:
        """Make the fakes available as the engine and rollout backends of their names."""
        plugins.register_engine(self.engine_name, self.engine_plugin, distribution="geartrain-testing-fakes")
        plugins.register_rollout(self.rollout_name, self.rollout_plugin, distribution="geartrain-testing-fakes")

    def unregister(self) -> None:
        plugins.unregister("engine", self.engine_name)
        plugins.unregister("rollout", self.rollout_name)

    @contextmanager
    def registered(self) -> Iterator[FakeBackends]:
        """Registered for the duration of a ``with`` block."""
        self.register()
        try:
            yield self
        finally:
            self.unregister()

    def of(self, role: str | None = None, hook: str | None = None) -> list[FakeCall]:
        """The recorded calls, filtered by role and/or hook, in order."""
        return [c for c in self.calls if (role is None or c.role == role) and (hook is None or c.hook == hook)]

    def hooks(self, role: str | None = None) -> list[str]:
        """The hook names called (on ``role``), in order."""
        return [c.hook for c in self.of(role)]

    def clear(self) -> None:
        self.calls.clear()


def write_fake_job(directory: Path, output_dir: str | Path, trainer: str = "", reward: str = "arithmetic") -> Path:
    """``directory/job.toml``: a job for the fake engine and rollout (registered by
    :class:`FakeBackends`) on the tiny qwen2 model, over four ``1+1=`` rows written to
    ``directory/train.jsonl`` in batches of 2, writing to ``output_dir``. ``trainer`` adds
    lines to its ``[trainer]`` table (TOML), ``reward`` is ``reward.function``. Returns the path."""
    (directory / "train.jsonl").write_text('{"prompt": "1+1=", "ground_truth": "2"}\n' * 4)
    job = directory / "job.toml"
    job.write_text(
        f'[model]\ntiny = "qwen2"\n[reward]\nfunction = "{reward}"\n[actor.engine]\nbackend = "fake"\n'
        '[rollout]\nbackend = "fake"\n'
        '[data]\npath = "train.jsonl"\nbatch_size = 2\napply_chat_template = false\n'
        f'[trainer]\noutput_dir = "{output_dir}"\n{trainer}'
    )
    return job
