"""megatron's DDP wrapper (contiguous fp32 gradient buffers, one all-reduce per step),
megatron's optimizer (Adam with decoupled weight decay on every parameter, as the core's
``OptimConfig`` says; optionally the distributed optimizer), the LR schedule and the
clipped step that skips non-finite gradients.

Functions of the model chunks, the optimizer and the core's ``OptimConfig``: this module
does not know the engine's model handle (``engine.py`` imports it, never the reverse)."""

from __future__ import annotations

import math
from typing import Any

import torch
from geartrain.config import OptimConfig
from geartrain.optim import lr_factor
from torch import nn

from geartrain_megatron.compat import cpu_compat
from geartrain_megatron.options import MegatronOptions


def wrap_ddp(chunks: list[nn.Module], options: MegatronOptions) -> list[nn.Module]:
    """Wrap each chunk in megatron's ``DistributedDataParallel`` and register the gradient
    finalisation (DP all-reduce, tied-embedding all-reduce across the first and last
    stage) that the pipeline schedules call after the last backward."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    config = chunks[0].config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=options.use_distributed_optimizer,
    )
    wrapped = [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [w.no_sync for w in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    return wrapped


def build_optimizer(chunks: list[nn.Module], cfg: OptimConfig, options: MegatronOptions) -> Any:
    """megatron's optimizer over the (DDP-wrapped) ``chunks`` with the core's settings."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.lr * cfg.min_lr_ratio,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.betas[0],
        adam_beta2=cfg.betas[1],
        adam_eps=cfg.eps,
        decoupled_weight_decay=True,
        clip_grad=cfg.clip_grad,
        use_distributed_optimizer=options.use_distributed_optimizer,
    )
    # config_overrides={}: every parameter decays (megatron's default exempts biases and
    # norms; the core's OptimConfig, and the other engines, decay everything)
    return get_megatron_optimizer(config, chunks, config_overrides={})


def clipped_step(optimizer: Any, chunks: list[nn.Module], cfg: OptimConfig, steps: int) -> dict[str, float]:
    """One optimizer step at step ``steps``'s learning rate, clipped, skipped when the
    gradient norm is not finite (``skipped`` = 1: the caller does not count the step);
    gradients are zeroed either way. See :func:`geartrain.hookspecs.optimizer_step`."""
    lr = cfg.lr * lr_factor(steps, cfg)
    with cpu_compat():
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.prepare_grads()
        grad_norm = float(optimizer.get_grad_norm())
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            _clip(optimizer, cfg.clip_grad, grad_norm)
            optimizer.step_with_ready_grads()
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
    return {"grad_norm": grad_norm, "lr": lr, "skipped": float(skipped)}


@torch.no_grad()
def _clip(optimizer: Any, max_norm: float, total_norm: float) -> None:
    """Scale the main gradients by ``max_norm / total_norm`` when that is below 1 (the
    norm is megatron's, over all TP/PP/DP shards). Done here rather than with megatron's
    ``clip_grad_by_total_norm_fp32``, which insists on CUDA tensors."""
    if max_norm <= 0:  # the core's rule: clip_grad = 0 means no clipping
        return
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff >= 1.0:
        return
    # a MoE model gets a ChainedOptimizer (dense and expert parameters), whose own
    # get_parameters() refuses to pick one of its parts
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        for param in part.get_parameters():
            if param.grad is not None:
                param.grad.mul_(coeff)
