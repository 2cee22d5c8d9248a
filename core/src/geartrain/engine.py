"""The core's handle on one training-engine instance (on this rank)."""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import Any

from geartrain import plugins
from geartrain.batch import Batch
from geartrain.checkpoint import CheckpointManager
from geartrain.cluster.process_group import release_single_rank_group, with_process_group
from geartrain.cluster.reduce import sum_over_data_parallel
from geartrain.config import EngineConfig, ModelConfig, backend_config_errors, options_of, section_path
from geartrain.dcp_guard import check_dcp_pickles
from geartrain.errors import ConfigError, GeartrainError
from geartrain.types import (
    ADAPTERS_OFF,
    NEED_SUM_PI_SQUARED,
    OFFLOAD_KINDS,
    Capability,
    DataParallelCoordinates,
    EngineContext,
    LossFn,
    MemoryStats,
    StepOutput,
    SyncStats,
    WeightReceiver,
)
from geartrain.validation import capability_problems

#: The JSON file of a checkpoint that says what built it (see :meth:`Engine.save_checkpoint`).
ENGINE_RECORD = "engine.json"


class Engine:
    """One engine backend instance: a plugin manager holding exactly that backend (plus the
    enabled extensions) and the backend's model handle. Every method is one hook call;
    all of them are collective over the role's ranks."""

    def __init__(self, config: EngineConfig, model: ModelConfig, ctx: EngineContext) -> None:
        self.config = config
        self.model_config = model
        # a context built by hand for one rank gets the size-1 group the contract promises
        ctx, own_group = with_process_group(ctx)
        if own_group is not None:
            weakref.finalize(self, release_single_rank_group, own_group)
        self.ctx = ctx
        self.pm = plugins.create_manager("engine", config.backend, config.extensions)
        self.info = plugins.backend_info("engine", config.backend)
        problems = capability_problems(config, set(self.info.capabilities))
        problems += [(f"optim.{p}", m) for p, m in config.optim.schedule_problems()]
        problems = [(f"{section_path(ctx.role)}.{p}", m) for p, m in problems]
        if problems:
            raise ConfigError(problems, f"engine '{config.backend}' for role {ctx.role}")
        with backend_config_errors(section_path(ctx.role), config.backend):
            schema = self.pm.hook.config_schema()
            if schema is not None:
                config.options = options_of(config, schema)
            module = self.pm.hook.build_model(config=model, ctx=ctx)
            self.handle = self.pm.hook.shard(module=module, config=config, model_config=model, ctx=ctx)
        self.dp: DataParallelCoordinates = self.pm.hook.data_parallel_coordinates(
            model=self.handle
        ) or DataParallelCoordinates(rank=ctx.rank, size=ctx.world_size)

    @property
    def name(self) -> str:
        return self.config.backend

    def _require(self, result: Any, hook: str) -> Any:
        """``result`` of the hook ``hook``; a hook with no implementation and one whose
        implementations all returned ``None`` (pluggy's first-result call cannot tell them
        apart) are told apart here, because the fixes differ."""
        if result is not None:
            return result
        caller = getattr(self.pm.hook, hook)
        if not caller.get_hookimpls():
            raise GeartrainError(f"engine '{self.name}' does not implement the '{hook}' hook")
        spec = caller.spec
        expected = spec.function.__annotations__.get("return", "a value") if spec is not None else "a value"
        raise GeartrainError(
            f"engine '{self.name}' returned None from its '{hook}' hook ({self._origin()});"
            f" the hook must return {expected} (see geartrain.hookspecs.{hook}): a missing return statement?"
        )

    def _origin(self) -> str:
        info = self.info
        return f"{info.distribution} {info.version or '?'}: {info.module}" if info.distribution else info.module

    def forward_backward(
        self, batch: Batch, loss_fn: LossFn | None = None, *, forward_only: bool = False
    ) -> StepOutput:
        """The backend's ``forward_backward`` on this rank's slice; its metrics (local to
        the slice) come back summed over the data-parallel ranks (see
        :mod:`geartrain.cluster.reduce`), the same on every rank."""
        out = self.pm.hook.forward_backward(model=self.handle, batch=batch, loss_fn=loss_fn, forward_only=forward_only)
        out = self._require(out, "forward_backward")
        out.metrics = sum_over_data_parallel(
            out.metrics,
            group=self.ctx.process_group,
            world_size=self.ctx.world_size,
            dp=self.dp,
            device=self.ctx.device if self.ctx.device == "cpu" else f"{self.ctx.device}:{self.ctx.local_rank}",
        )
        return out

    def compute_log_probs(
        self, batch: Batch, *, entropy: bool = False, adapters_off: bool = False, sum_pi_squared: bool = False
    ) -> StepOutput:
        """Forward-only per-token outputs (reference / old log-probs). ``adapters_off``: the
        base model without its LoRA adapters (engines that train adapters; see
        :data:`geartrain.types.ADAPTERS_OFF`). ``sum_pi_squared``: also ``Σ_v π(v)²`` per
        token (engines that declare ``sum_pi_squared``; see
        :data:`geartrain.types.NEED_SUM_PI_SQUARED`)."""
        if adapters_off and self.config.lora is None:
            raise GeartrainError(f"engine '{self.name}' for role {self.ctx.role} has no LoRA adapters to turn off")
        if sum_pi_squared and Capability.SUM_PI_SQUARED not in self.info.capabilities:
            raise GeartrainError(
                f"engine '{self.name}' does not declare '{Capability.SUM_PI_SQUARED}': it cannot return sum_pi_squared"
            )
        info_before = dict(batch.info)
        batch.info["need_entropy"] = entropy
        batch.info[NEED_SUM_PI_SQUARED] = sum_pi_squared
        batch.info[ADAPTERS_OFF] = adapters_off
        try:
            return self.forward_backward(batch, None, forward_only=True)
        finally:
            batch.info.clear()
            batch.info.update(info_before)

    def optimizer_step(self) -> dict[str, float]:
        return self._require(self.pm.hook.optimizer_step(model=self.handle), "optimizer_step")

    def sync_weights(self, rollout: WeightReceiver | None) -> SyncStats:
        """``reshard_for_rollout``: stream the current weights into ``rollout``."""
        return self._require(
            self.pm.hook.reshard_for_rollout(model=self.handle, rollout=rollout), "reshard_for_rollout"
        )

    def save_checkpoint(self, manager: CheckpointManager, step: int, extra: dict[str, Any]) -> Path:
        """Save atomically as checkpoint ``step`` under ``manager.root``. Rank 0 also writes
        :data:`ENGINE_RECORD` (covered by the checkpoint's manifest): the engine and model
        configs this engine was built from, the step, and ``extra["record"]`` (plain JSON
        data the caller wants readable without building an engine), so that ``geartrain
        export`` builds from what the checkpoint records, not from a run's ``config.json``."""

        def write(tmp: Path) -> None:
            if self.ctx.rank == 0:
                record = {
                    "step": step,
                    "engine": self.config.model_dump(mode="json"),
                    "model": self.model_config.model_dump(mode="json"),
                    **dict(extra.get("record") or {}),
                }
                (tmp / ENGINE_RECORD).write_text(json.dumps(record, indent=2), encoding="utf-8")
            self.pm.hook.save_checkpoint(model=self.handle, path=tmp, extra=extra)

        return manager.save(step, write)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore a complete checkpoint; returns the ``extra`` dict saved with it."""
        path = CheckpointManager.check_complete(path)
        check_dcp_pickles(path)  # before any backend opens a pickle of it
        extra = self.pm.hook.load_checkpoint(model=self.handle, path=path)
        return extra if extra is not None else {}

    def export_hf(self, path: str | Path, tokenizer: Any | None = None) -> Path:
        path = Path(path)
        if not self.pm.hook.export_hf.get_hookimpls():
            raise GeartrainError(f"engine '{self.name}' does not implement the 'export_hf' hook")
        self.pm.hook.export_hf(model=self.handle, path=path, tokenizer=tokenizer)
        return path

    def offload(self, what: frozenset[str] = OFFLOAD_KINDS) -> MemoryStats:
        unknown = set(what) - OFFLOAD_KINDS
        if unknown:
            raise ValueError(f"cannot offload {sorted(unknown)}; choose from {sorted(OFFLOAD_KINDS)}")
        return self._require(self.pm.hook.offload(model=self.handle, what=what), "offload")

    def onload(self) -> MemoryStats:
        return self._require(self.pm.hook.onload(model=self.handle), "onload")
