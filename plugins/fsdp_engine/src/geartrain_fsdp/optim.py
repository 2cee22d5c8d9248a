"""AdamW, LR schedules and the clipped optimizer step."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from geartrain.config import OptimConfig
from torch.optim.lr_scheduler import LambdaLR


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of ``cfg.lr`` for optimizer step ``step`` (0-based): linear warmup over
    ``warmup_steps`` (step 0 already trains at ``1 / warmup_steps``), then constant, or a
    cosine / linear decay to ``min_lr_ratio`` at ``total_steps``."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    assert cfg.total_steps is not None
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, max(0.0, (step - cfg.warmup_steps) / span))
    if cfg.lr_schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        decay = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


def build_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """AdamW over ``params`` and its LR scheduler."""
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    scheduler = LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
    return optimizer, scheduler


@dataclass(kw_only=True, slots=True)
class StepResult:
    grad_norm: float
    lr: float
    skipped: bool


def clipped_step(
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, scheduler: LambdaLR, clip: float
) -> StepResult:
    """Clip the (possibly DTensor) gradients to ``clip``, step optimizer and scheduler and
    zero the gradients. A non-finite norm skips the update and leaves the schedule where
    it was. Collective over the FSDP mesh (the norm is reduced across shards)."""
    lr = float(optimizer.param_groups[0]["lr"])
    with_grad = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(with_grad, clip) if with_grad else torch.zeros(())
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    grad_norm = float(norm)
    skipped = not math.isfinite(grad_norm)
    if not skipped:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(grad_norm=grad_norm, lr=lr, skipped=skipped)
