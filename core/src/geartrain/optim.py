"""The optimizer, LR schedule and clipped step every engine builds from :class:`OptimConfig`.

An engine calls :func:`build_optimizer` in ``shard`` and :func:`clipped_step` in
``optimizer_step``; then every backend trains with the same numbers.

**The schedule.** With ``s`` the 0-based optimizer step (the number of updates applied
before this one), ``W = warmup_steps``, ``N = total_steps`` and ``r = min_lr_ratio``, the
update at step ``s`` uses ``lr * lr_factor(s)`` where

* ``s < W`` (warmup): ``(s + 1) / W`` — the first update already trains at ``lr / W`` and
  step ``W - 1`` at the full ``lr``;
* otherwise, ``constant``: ``1``;
* otherwise, with ``p = clamp((s - W) / max(1, N - W), 0, 1)`` the decay progress:
  ``linear``: ``r + (1 - r) * (1 - p)``; ``cosine``: ``r + (1 - r) * (1 + cos(pi * p)) / 2``.
  Both reach ``r`` at ``s = N`` and stay there.

**The step** (:func:`clipped_step`): the global gradient norm is measured over every
parameter with a gradient; ``clip_grad > 0`` scales the gradients so that norm is at most
``clip_grad`` (``torch.nn.utils.clip_grad_norm_``), ``clip_grad = 0`` measures without
clipping. A non-finite norm skips the update: parameters, optimizer state and schedule stay
as they were. Gradients are zeroed either way. The reported ``lr`` is **the learning rate
this step's update used** (for a skipped step: the one it would have used), so the first
step of a warmup reports ``lr / W``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR

from geartrain.config import OptimConfig

__all__ = ["StepResult", "build_optimizer", "clipped_step", "fused_adamw", "load_scheduler_state", "lr_factor"]


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of ``cfg.lr`` for the update at 0-based optimizer step ``step`` (the
    formula is in this module's docstring)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    if cfg.total_steps is None:
        raise ValueError(f"lr_schedule '{cfg.lr_schedule}' needs optim.total_steps")
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, max(0.0, (step - cfg.warmup_steps) / span))
    if cfg.lr_schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        decay = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


def fused_adamw(device_types: set[str]) -> bool:
    """Whether AdamW runs its fused kernel (one kernel per parameter group instead of
    several foreach passes): when every parameter is on CUDA. Elsewhere (CPU, CPU offload)
    torch's default implementation, whose numbers the CPU tests compare against."""
    return device_types == {"cuda"}


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """AdamW over ``params`` (``lr``, ``betas``, ``eps``, ``weight_decay`` from ``cfg``) and
    its LR scheduler (:func:`lr_factor`). Parameters may be DTensors (FSDP2). Fused on
    CUDA (:func:`fused_adamw`)."""
    params = list(params)
    fused = fused_adamw({p.device.type for p in params})
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused or None
    )
    scheduler = LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
    return optimizer, scheduler


def load_scheduler_state(scheduler: LambdaLR, state: dict) -> None:
    """Restore ``scheduler``'s position from a checkpoint and set its optimizer's learning
    rates to what this scheduler's schedule gives there. The optimizer's state restores the
    rates the *saved* schedule set; after a resume that changed the schedule's horizon
    (``trainer.total_steps``), the first step trained with the old schedule's rate (its end,
    the minimum) and only the next ones with the new. Unchanged, the rates are the same."""
    scheduler.load_state_dict(state)
    position = scheduler.last_epoch
    rates = [base * factor(position) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, rate in zip(scheduler.optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    scheduler._last_lr = rates  # noqa: SLF001 - what get_last_lr() reports, as step() would set it


@dataclass(kw_only=True, slots=True)
class StepResult:
    """What one :func:`clipped_step` did."""

    grad_norm: float
    """Global gradient norm before clipping (``inf``/``nan`` when the step was skipped)."""
    lr: float
    """The learning rate this step's update used (of the first parameter group)."""
    skipped: bool
    """True when the norm was not finite and nothing was updated."""

    def metrics(self) -> dict[str, float]:
        """The ``optimizer_step`` hook's return value: ``grad_norm``, ``lr``, ``skipped``."""
        return {"grad_norm": self.grad_norm, "lr": self.lr, "skipped": float(self.skipped)}


def clipped_step(
    params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer, scheduler: LambdaLR, clip: float
) -> StepResult:
    """Measure the gradient norm over ``params``, clip it to ``clip`` (``0``: no clipping),
    step ``optimizer`` and ``scheduler`` unless the norm is not finite, and zero the
    gradients. With DTensor gradients the norm is reduced over their mesh, so it is
    collective: every rank of the mesh must call it."""
    lr = float(optimizer.param_groups[0]["lr"])
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        norm = torch.zeros(())
    elif clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(with_grad, clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in with_grad])
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    grad_norm = float(norm)
    skipped = not math.isfinite(grad_norm)
    if not skipped:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(grad_norm=grad_norm, lr=lr, skipped=skipped)
