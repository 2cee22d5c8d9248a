"""The ``simple`` engine: every engine hook, in plain PyTorch, on one process.

No parallelism and no packing: micro-batches are padded rows grouped under a token budget
(``geartrain.micro_batches.plan_micro_batches``).
It is small enough to read in one sitting, and it passes geartrain's engine conformance
suite — the tutorial in docs/plugins.md builds it step by step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import geartrain
import torch
from geartrain.micro_batches import plan_micro_batches
from geartrain.modeling import build_hf_model
from geartrain.optim import build_optimizer, clipped_step
from geartrain.weights import send_weights
from pydantic import BaseModel, ConfigDict


class SimpleOptions(BaseModel):
    """``[actor.engine.options]`` of the simple engine."""

    model_config = ConfigDict(extra="forbid")
    deterministic: bool = True
    """Ask torch for deterministic kernels (bitwise-reproducible resumes)."""


@dataclass
class SimpleModel:
    module: torch.nn.Module
    config: geartrain.EngineConfig
    ctx: geartrain.EngineContext
    optimizer: torch.optim.Optimizer | None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    value_head: bool
    metrics: dict[str, float] = field(default_factory=dict)


@geartrain.hookimpl
def capabilities() -> list[str]:
    return [geartrain.Capability.CPU, geartrain.Capability.HF_EXPORT, geartrain.Capability.VALUE_HEAD]


@geartrain.hookimpl
def config_schema() -> type[BaseModel]:
    return SimpleOptions


@geartrain.hookimpl
def build_model(config: geartrain.ModelConfig, ctx: geartrain.EngineContext) -> torch.nn.Module:
    return build_hf_model(config, device=ctx.device)


@geartrain.hookimpl
def shard(
    module: torch.nn.Module,
    config: geartrain.EngineConfig,
    model_config: geartrain.ModelConfig,
    ctx: geartrain.EngineContext,
) -> SimpleModel:
    if ctx.world_size != 1:
        raise ValueError(f"the simple engine runs on one rank, got world_size={ctx.world_size}")
    if config.options.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    optimizer = scheduler = None
    if config.optim.lr > 0:
        optimizer, scheduler = build_optimizer(module.parameters(), config.optim)
    return SimpleModel(module.train(), config, ctx, optimizer, scheduler, model_config.value_head)


def _per_token(model: SimpleModel, micro: geartrain.Batch, need_entropy: bool) -> dict[str, torch.Tensor]:
    ids, mask = micro["input_ids"], micro["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model.module(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    valid = torch.zeros_like(mask, dtype=torch.bool)
    valid[:, 1:] = mask[:, 1:].bool() & mask[:, :-1].bool()
    out: dict[str, torch.Tensor] = {}
    if model.value_head:
        values = torch.zeros(ids.shape, dtype=logits.dtype)
        values[:, 1:] = logits[:, :-1, 0]
        out["values"] = values * valid
        return out
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    log_probs = torch.zeros(ids.shape, dtype=logits.dtype)
    log_probs[:, 1:] = logp.gather(-1, ids[:, 1:, None])[..., 0]
    out["log_probs"] = log_probs * valid
    if need_entropy:
        entropy = torch.zeros(ids.shape, dtype=logits.dtype)
        entropy[:, 1:] = -(logp.exp() * logp).sum(-1)
        out["entropy"] = entropy * valid
    return out


@geartrain.hookimpl
def forward_backward(
    model: SimpleModel, batch: geartrain.Batch, loss_fn: geartrain.LossFn | None, forward_only: bool
) -> geartrain.StepOutput:
    for key in ("input_ids", "attention_mask"):
        if key not in batch:
            raise KeyError(f"the batch has no '{key}' (it has {batch.tensor_keys()})")
    if loss_fn is not None and "loss_mask" not in batch:
        raise KeyError("a batch trained with a loss_fn needs 'loss_mask'")
    lengths = batch["attention_mask"].sum(-1).tolist()
    # rows grouped under the token budget, first-fit decreasing: a group's rows need not be
    # consecutive (rows 0 and 3, then 1 and 2), so the outputs are put back in batch order below
    groups = plan_micro_batches(lengths, model.config.max_tokens_per_micro_batch)
    ctx_counts = dict(
        global_tokens=int(batch["loss_mask"].sum()) if "loss_mask" in batch else 0,
        global_sequences=len(batch),
    )
    need_entropy = bool(batch.info.get("need_entropy", False))
    pieces: list[dict[str, torch.Tensor]] = []
    metrics: dict[str, float] = {}
    for i, rows in enumerate(groups):
        micro = batch.index(rows)
        with torch.set_grad_enabled(not forward_only):
            outputs = _per_token(model, micro, need_entropy)
            if loss_fn is not None:
                loss_ctx = geartrain.LossContext(micro_batch_index=i, num_micro_batches=len(groups), **ctx_counts)
                loss, loss_metrics = loss_fn(outputs, micro, loss_ctx)
                if not forward_only:
                    loss.backward()
                for k, v in loss_metrics.items():
                    metrics[k] = metrics.get(k, 0.0) + float(v)
        pieces.append({k: v.detach() for k, v in outputs.items()})
    order = torch.tensor([row for rows in groups for row in rows]).argsort()  # piece order -> batch order
    merged = {k: torch.cat([p[k] for p in pieces])[order] for k in pieces[0]}
    metrics.update(tokens=float(sum(lengths)), micro_batches=float(len(groups)))
    return geartrain.StepOutput(outputs=merged, metrics=metrics)


@geartrain.hookimpl
def optimizer_step(model: SimpleModel) -> dict[str, float]:
    if model.optimizer is None:
        raise RuntimeError(f"role {model.ctx.role} was built without an optimizer (lr=0)")
    step = clipped_step(model.module.parameters(), model.optimizer, model.scheduler, model.config.optim.clip_grad)
    return step.metrics()


@geartrain.hookimpl
def reshard_for_rollout(model: SimpleModel, rollout: geartrain.WeightReceiver | None) -> geartrain.SyncStats:
    return send_weights(model.module.state_dict(keep_vars=True).items(), rollout)


@geartrain.hookimpl
def save_checkpoint(model: SimpleModel, path: Path, extra: dict[str, Any]) -> None:
    geartrain.save_state(
        {
            "model": model.module.state_dict(),
            "optimizer": model.optimizer.state_dict() if model.optimizer else None,
            "scheduler": model.scheduler.state_dict() if model.scheduler else None,
            "rng": torch.get_rng_state(),
            "extra": extra,
        },
        Path(path) / "state.pt",
    )


@geartrain.hookimpl
def load_checkpoint(model: SimpleModel, path: Path) -> dict[str, Any]:
    state = geartrain.load_state(Path(path) / "state.pt")  # weights_only: never runs code from the file
    model.module.load_state_dict(state["model"])
    if model.optimizer and state["optimizer"]:
        model.optimizer.load_state_dict(state["optimizer"])
        model.scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return state["extra"]


@geartrain.hookimpl
def export_hf(model: SimpleModel, path: Path, tokenizer: Any | None) -> None:
    model.module.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
