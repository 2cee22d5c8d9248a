"""Shared pieces of the megatron engine tests: batches, the loss, plain transformers
references, and a spawner for real multi-process gloo runs."""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from geartrain.batch import Batch
from geartrain.config import EngineConfig, ModelConfig, OptimConfig, ParallelConfig
from geartrain.engine import Engine
from geartrain.modeling import build_hf_model
from geartrain.testing.reference import reference_token_outputs
from geartrain.types import EngineContext, LossContext

#: the tiny model of the multi-rank tests: 4 layers so that pp=2 x vpp=2 has one per stage
OVERRIDES = {"num_hidden_layers": 4}
STEPS = 2


def make_batch(seed: int = 0, rows: int = 5, prompt_max: int = 6, response_max: int = 8, vocab: int = 128) -> Batch:
    """Rows of ``[left pad | prompt | response | right pad]`` with random lengths."""
    g = torch.Generator().manual_seed(seed)
    width = prompt_max + response_max
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    loss_mask = torch.zeros(rows, width, dtype=torch.long)
    for r in range(rows):
        p = int(torch.randint(1, prompt_max + 1, (1,), generator=g))
        a = int(torch.randint(1, response_max + 1, (1,), generator=g))
        ids[r, prompt_max - p : prompt_max + a] = torch.randint(4, vocab, (p + a,), generator=g)
        mask[r, prompt_max - p : prompt_max + a] = 1
        loss_mask[r, prompt_max : prompt_max + a] = 1
    return Batch({"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}, info={"prompt_length": prompt_max})


def token_mean_loss(
    outputs: dict[str, torch.Tensor], mb: Batch, ctx: LossContext
) -> tuple[torch.Tensor, dict[str, float]]:
    mask = mb["loss_mask"].to(outputs["log_probs"].dtype)
    share = -(outputs["log_probs"] * mask).sum() / ctx.global_tokens
    return share, {"loss": float(share.detach())}


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
    ids, mask = batch["input_ids"], batch["attention_mask"]
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    logits = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    keep = (mask[:, 1:] * mask[:, :-1]).bool()
    return torch.cat([torch.zeros(ids.shape[0], 1), torch.where(keep, lp, 0.0)], 1)


# ----------------------------------------------------------------------------- spawning


def _entry(rank: int, world: int, store_path: str, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": True, "result": result}, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, Path(out_dir) / f"rank{rank}.pt")
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned gloo processes; return each
    rank's result (``fn`` must be a module-level function)."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(
            _entry,
            args=(world, os.path.join(tmp, "store"), tmp, fn, args),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish in {timeout} s")
        except Exception:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            errors = [torch.load(f, weights_only=False) for f in sorted(Path(tmp).glob("rank*.pt"))]
            details = "\n".join(e["error"] for e in errors if not e["ok"])
            raise RuntimeError(f"{fn.__name__} failed:\n{details}") from None
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False)["result"] for r in range(world)]
