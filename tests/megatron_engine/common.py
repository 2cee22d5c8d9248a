"""Shared pieces of the megatron engine tests: engines, the tiny model, a receiver and
the plain transformers reference run. Batches, the token-mean loss, the reference forward
and the multi-process spawner are the core's (:mod:`geartrain.testing.reference`,
:mod:`geartrain.testing.spawn`), shared with the FSDP engine's tests."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from geartrain.batch import Batch
from geartrain.config import EngineConfig, ModelConfig, OptimConfig, ParallelConfig
from geartrain.engine import Engine
from geartrain.modeling import build_hf_model
from geartrain.testing.reference import (
    random_batch,
    reference_logits,
    reference_token_outputs,
    token_outputs_from_logits,
)
from geartrain.testing.reference import token_mean_nll_loss as token_mean_loss
from geartrain.testing.spawn import run_ranks
from geartrain.types import EngineContext

__all__ = [
    "OVERRIDES",
    "STEPS",
    "Receiver",
    "make_batch",
    "make_engine",
    "model_config",
    "rank_context",
    "reference",
    "reference_token_outputs_grad",
    "run_ranks",
    "token_mean_loss",
]

#: the tiny model of the multi-rank tests: 4 layers so that pp=2 x vpp=2 has one per stage
OVERRIDES = {"num_hidden_layers": 4}
STEPS = 2


#: this suite's batches: 5 rows, prompts up to 6 tokens, responses up to 8
make_batch = functools.partial(random_batch, rows=5, prompt_max=6, response_max=8)


def model_config(family: str, **kw: Any) -> ModelConfig:
    return ModelConfig(tiny=family, seed=1, config_overrides=dict(OVERRIDES), **kw)


def make_engine(
    family: str, rank: int, world: int, *, budget: int = 4096, options: dict | None = None, **parallel: Any
) -> Engine:
    config = EngineConfig(
        backend="megatron",
        parallel=ParallelConfig(**parallel),
        optim=OptimConfig(lr=1e-3, weight_decay=0.01, clip_grad=1.0),
        max_tokens_per_micro_batch=budget,
        options=options or {},
    )
    return Engine(config, model_config(family), rank_context(rank, world))


def rank_context(rank: int, world: int) -> EngineContext:
    """The context a worker group gives a rank: the whole gloo world of ``run_ranks`` is
    the role's group; one rank gets the inline placement's group of size 1."""
    from geartrain.cluster.process_group import acquire_single_rank_group

    group = dist.group.WORLD if world > 1 else acquire_single_rank_group("cpu")
    return EngineContext(role="actor", rank=rank, world_size=world, seed=0, process_group=group)


class Receiver:
    """A weight receiver that keeps what it is sent."""

    def __init__(self, bucket_bytes: int = 1 << 15) -> None:
        self.dtype = torch.float32
        self.bucket_bytes = bucket_bytes
        self.tensors: dict[str, torch.Tensor] = {}

    def update_weights(self, named_tensors: Any) -> None:
        for name, tensor in named_tensors:
            self.tensors[name] = tensor.detach().clone()


def reference(family: str) -> dict[str, Any]:
    """Plain transformers on one process: log-probs/entropy of ``make_batch(0)``, then
    ``STEPS`` AdamW steps on ``make_batch(10 + step)`` (losses, grad norms, final weights)."""
    hf = build_hf_model(model_config(family)).train()
    out: dict[str, Any] = {"forward": reference_token_outputs(hf, make_batch(0)), "loss": [], "grad_norm": []}
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for step in range(STEPS):
        batch = make_batch(10 + step)
        lp = reference_token_outputs_grad(hf, batch)
        mask = batch["loss_mask"].float()
        loss = -(lp * mask).sum() / mask.sum()
        loss.backward()
        out["loss"].append(loss.item())
        out["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
    out["weights"] = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return out


def reference_token_outputs_grad(hf: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Per-token log-probs ``[B, T]`` of a plain transformers forward, with autograd."""
    outputs = token_outputs_from_logits(reference_logits(hf, batch), batch["input_ids"], batch["attention_mask"])
    return outputs["log_probs"]
