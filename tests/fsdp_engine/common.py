"""Shared pieces of the fsdp engine tests: engines, a value loss and weight/gradient
readers. Batches, the token-mean loss, the transformers reference and the multi-process
spawner are the core's (:mod:`geartrain.testing.reference`, :mod:`geartrain.testing.spawn`),
shared with the megatron engine's tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from geartrain.batch import Batch
from geartrain.config import EngineConfig, ModelConfig, OptimConfig, ParallelConfig
from geartrain.engine import Engine
from geartrain.testing.reference import random_batch as make_batch
from geartrain.testing.reference import reference_logits, token_outputs_from_logits
from geartrain.testing.reference import token_mean_nll_loss as token_mean_loss
from geartrain.testing.spawn import run_ranks
from geartrain.types import EngineContext, LossContext

__all__ = [
    "engine_config",
    "full_grads",
    "full_params",
    "make_batch",
    "make_engine",
    "rank_context",
    "reference_outputs",
    "run_ranks",
    "token_mean_loss",
    "value_loss",
]


def reference_outputs(model: torch.nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    """Per-token ``log_probs``/``entropy`` from a plain transformers forward, *with* autograd
    (the reference training loop backpropagates through them; the core's
    ``reference_token_outputs`` runs under ``no_grad``)."""
    return token_outputs_from_logits(reference_logits(model, batch), batch["input_ids"], batch["attention_mask"])


def value_loss(outputs: dict[str, torch.Tensor], mb: Batch, ctx: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
    mask = mb["loss_mask"].to(outputs["values"].dtype)
    share = ((outputs["values"] - 1.0) ** 2 * mask).sum() / ctx.global_tokens
    return share, {"vloss": float(share.detach())}


def engine_config(
    *, dp: int = 1, sp: int = 1, lr: float = 1e-3, budget: int = 4096, options: dict | None = None, **optim: Any
) -> EngineConfig:
    return EngineConfig(
        backend="fsdp",
        parallel=ParallelConfig(dp=dp, sp=sp),
        optim=OptimConfig(lr=lr, weight_decay=0.01, clip_grad=1.0, **optim),
        max_tokens_per_micro_batch=budget,
        options=options or {},
    )


def make_engine(
    family: str = "qwen2", *, rank: int = 0, world: int = 1, value_head: bool = False, seed: int = 0, **kw: Any
) -> Engine:
    model = ModelConfig(tiny=family, value_head=value_head, seed=seed)
    return Engine(engine_config(**kw), model, rank_context(rank, world, seed=seed))


def rank_context(rank: int, world: int, *, seed: int = 0, role: str = "actor") -> EngineContext:
    """The context a worker group gives a rank of ``run_ranks``: the whole gloo world is
    the role's group."""
    group = dist.group.WORLD if world > 1 else None
    return EngineContext(role=role, rank=rank, world_size=world, seed=seed, process_group=group)


def full_params(engine: Engine) -> dict[str, torch.Tensor]:
    """Every weight, full, on CPU, by its transformers name (collective)."""
    out = {}
    for name, t in engine.handle.hf.state_dict().items():
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()
    return out


def full_grads(engine: Engine) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in engine.handle.hf.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().cpu().clone()
    return out
