"""Shared pieces of the fsdp engine tests: batches, a token-mean loss, plain
transformers references, and a spawner for real multi-process gloo runs."""

from __future__ import annotations

import os
import tempfile
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
from geartrain.types import EngineContext, LossContext


def make_batch(seed: int = 0, rows: int = 6, prompt_max: int = 7, response_max: int = 9, vocab: int = 128) -> Batch:
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
    """``-sum(log p * loss_mask) / global_tokens``: this micro-batch's share."""
    mask = mb["loss_mask"].to(outputs["log_probs"].dtype)
    share = -(outputs["log_probs"] * mask).sum() / ctx.global_tokens
    return share, {"loss": float(share.detach())}


def value_loss(outputs: dict[str, torch.Tensor], mb: Batch, ctx: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
    mask = mb["loss_mask"].to(outputs["values"].dtype)
    share = ((outputs["values"] - 1.0) ** 2 * mask).sum() / ctx.global_tokens
    return share, {"vloss": float(share.detach())}


def reference_outputs(hf: torch.nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    """Per-token log-probs and entropy ``[B, T]`` from a plain transformers forward on the
    padded batch (position ids counted over real tokens)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    logits = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    logp_all = torch.log_softmax(logits[:, :-1], dim=-1)
    lp = logp_all.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    keep = (mask[:, 1:] * mask[:, :-1]).bool()
    z = torch.zeros(ids.shape[0], 1)
    return {
        "log_probs": torch.cat([z, torch.where(keep, lp, 0.0)], 1),
        "entropy": torch.cat([z, torch.where(keep, ent, 0.0)], 1),
    }


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


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 240.0) -> list[Any]:
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
        import time

        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish in {timeout} s")
        results = []
        for r in range(world):
            rec = torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False)
            if not rec["ok"]:
                raise RuntimeError(f"rank {r} failed:\n{rec['error']}")
            results.append(rec["result"])
        return results
