"""Functions run inside spawned gloo ranks (module level so that spawn can import them).
Each returns plain CPU tensors / floats for the test process to compare."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from geartrain.checkpoint import CheckpointManager

from .common import full_grads, full_params, make_batch, make_engine, rank_context, token_mean_loss


class Receiver:
    """A weight receiver that keeps what it is sent (and the largest bucket it saw)."""

    def __init__(self, dtype: torch.dtype, bucket_bytes: int) -> None:
        self._dtype, self._bucket = dtype, bucket_bytes
        self.received: dict[str, torch.Tensor] = {}

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def bucket_bytes(self) -> int:
        return self._bucket

    def update_weights(self, named_tensors: Any) -> None:
        for name, tensor in named_tensors:
            self.received[name] = tensor.detach().cpu().clone()


def train_steps(
    rank: int, world: int, family: str, steps: int, options: dict, budget: int, seed: int = 0
) -> dict[str, Any]:
    """dp=world training on ``make_batch(seed + step)``: per step the rank's log-probs,
    summed loss metric, full grads (first step), optimizer metrics; then the final full
    params, a weight sync into a receiver and an HF export (path in options['_export'])."""
    export = options.pop("_export", None)
    engine = make_engine(family, rank=rank, world=world, dp=world, budget=budget, options=options)
    out: dict[str, Any] = {"log_probs": [], "entropy": [], "loss": [], "grad_norm": [], "micro_batches": []}
    for step in range(steps):
        batch = make_batch(seed + step).split(engine.dp.size)[engine.dp.rank]
        if step == 0:
            out["entropy"] = engine.compute_log_probs(batch, entropy=True).outputs["entropy"]
        res = engine.forward_backward(batch, token_mean_loss)
        out["log_probs"].append(res.outputs["log_probs"])
        out["loss"].append(res.metrics["loss"])
        out["micro_batches"].append(res.metrics["micro_batches"])
        if step == 0:
            out["grads"] = full_grads(engine)
        out["grad_norm"].append(engine.optimizer_step()["grad_norm"])
    out["params"] = full_params(engine)
    # uneven ranks: rank 0 needs 2 micro-batches, rank 1 (one row) 1 -> it runs a filler
    uneven = make_batch(104, rows=3).split(engine.dp.size)[engine.dp.rank]
    res = engine.forward_backward(uneven, token_mean_loss)
    out["uneven"] = (res.outputs["log_probs"], res.metrics)
    for p in engine.handle.module.parameters():
        p.grad = None
    receiver = Receiver(torch.float32, 20_000) if rank == 0 else None
    stats = engine.sync_weights(receiver)
    out["sync"] = (receiver.received if receiver else None, asdict(stats))  # results are plain data
    if export:
        from geartrain.testing import tiny_tokenizer

        engine.export_hf(export, tiny_tokenizer())
        # a checkpoint (path) model: ranks > 0 build it on the meta device and receive
        # rank 0's weights while sharding
        from geartrain.config import ModelConfig
        from geartrain.engine import Engine

        from .common import engine_config

        loaded = Engine(engine_config(dp=world), ModelConfig(path=export), rank_context(rank, world))
        out["loaded_params"] = full_params(loaded)
    return out


def sequence_parallel_step(rank: int, world: int, family: str, sp: int, overrides: dict, budget: int) -> dict[str, Any]:
    """One forward/backward with dp = world / sp on a packed variable-length batch."""
    from geartrain.config import ModelConfig
    from geartrain.engine import Engine

    from .common import engine_config

    config = engine_config(dp=world // sp, sp=sp, budget=budget)
    model = ModelConfig(tiny=family, config_overrides=overrides)
    engine = Engine(config, model, rank_context(rank, world))
    batch = make_batch(3, rows=5, prompt_max=9, response_max=12).split(engine.dp.size)[engine.dp.rank]
    res = engine.forward_backward(batch, token_mean_loss)
    return {"log_probs": res.outputs["log_probs"], "loss": res.metrics["loss"], "grads": full_grads(engine)}


def resume_run(rank: int, world: int, root: str, phase: str) -> dict[str, Any]:
    """``phase='straight'``: 4 steps in one go, and 2 steps then a checkpoint;
    ``phase='resume'``: load that checkpoint in a fresh process group and run 2 steps."""
    losses: list[float] = []

    def step(engine: Any, i: int) -> None:
        batch = make_batch(10 + i).split(engine.dp.size)[engine.dp.rank]
        losses.append(engine.forward_backward(batch, token_mean_loss).metrics["loss"])
        engine.optimizer_step()

    kw = dict(rank=rank, world=world, dp=world, budget=30, lr_schedule="cosine", warmup_steps=1, total_steps=4)
    manager = CheckpointManager(Path(root), keep_last=2)
    if phase == "straight":
        engine = make_engine("qwen2", **kw)
        for i in range(4):
            step(engine, i)
        straight = (list(losses), full_params(engine))
        losses.clear()
        del engine
        engine = make_engine("qwen2", **kw)
        for i in range(2):
            step(engine, i)
        engine.save_checkpoint(manager, 2, {"step": 2, "note": "two"})
        return {"straight": straight, "first_half": list(losses)}
    engine = make_engine("qwen2", **kw)
    latest = manager.latest()
    assert latest is not None
    extra = engine.load_checkpoint(latest)
    for i in range(2, 4):
        step(engine, i)
    return {"extra": extra, "losses": list(losses), "params": full_params(engine)}


def compile_pair_step(rank: int, world: int) -> dict[str, Any]:
    """One training step with sp = world (FSDP2 over the same ranks) and gradient
    checkpointing, eager and with ``options.compile`` (aot_eager): each engine's log-probs,
    loss and full grads."""
    from geartrain.config import ModelConfig
    from geartrain.engine import Engine
    from torch._dynamo.utils import counters

    from .common import engine_config

    batch = make_batch(3, rows=5, prompt_max=9, response_max=12)
    out: dict[str, Any] = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        options = {"compile": compiled, "compile_backend": "aot_eager"}
        config = engine_config(sp=world, budget=40, options=options)
        config = config.model_copy(update={"gradient_checkpointing": True})
        engine = Engine(config, ModelConfig(tiny="qwen2"), rank_context(rank, world))
        res = engine.forward_backward(batch, token_mean_loss)
        out[name] = {"log_probs": res.outputs["log_probs"], "loss": res.metrics["loss"], "grads": full_grads(engine)}
    out["graphs"] = int(counters["stats"]["unique_graphs"])
    return out


def gather_rows_like_full_tensor(rank: int, world: int) -> dict[str, Any]:
    """The weight sync's gather (``geartrain_fsdp.weights._full``) against
    ``DTensor.full_tensor`` on row-sharded tensors with uneven and empty pieces, and
    whether it stayed off ``full_tensor`` (gloo's coalesced all-gather, issue 38)."""
    from geartrain_fsdp import weights
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # every rank distributes the same global tensors
    shapes = {"even": (4, 3), "uneven": (5, 3), "one_row": (1, 4), "vector": (3,), "wide": (3, 2, 2)}
    sharded = {name: distribute_tensor(torch.randn(shape), mesh, [Shard(0)]) for name, shape in shapes.items()}
    replicated = distribute_tensor(torch.randn(2, 2), mesh, [Replicate()])
    expected = {name: t.full_tensor() for name, t in sharded.items()}
    calls: list[str] = []
    full_tensor = DTensor.full_tensor

    def counted(self: DTensor, **kwargs: Any) -> torch.Tensor:
        calls.append(str(self.placements))
        return full_tensor(self, **kwargs)

    DTensor.full_tensor = counted  # type: ignore[method-assign]
    try:
        got = {name: weights._full(t) for name, t in sharded.items()}
        got_replicated = weights._full(replicated)
    finally:
        DTensor.full_tensor = full_tensor  # type: ignore[method-assign]
    return {
        "local_rows": {name: t.to_local().shape[0] for name, t in sharded.items()},
        "equal": {name: bool(torch.equal(got[name], expected[name])) for name in shapes},
        "replicated_equal": bool(torch.equal(got_replicated, replicated.to_local())),
        "full_tensor_calls": calls,
    }
