"""Worker groups: the inline placement's process group (every role gets one, also on one
rank) and the rule that reduces a step's metrics across ranks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from geartrain import hookimpl
from geartrain.batch import Batch
from geartrain.cluster import create_worker_group
from geartrain.types import DataParallelCoordinates, EngineContext, StepOutput


class _ContextProbe:
    """A worker that keeps the context its worker group gave it."""

    def __init__(self, *, ctx: EngineContext) -> None:
        self.ctx = ctx

    def all_reduce(self, value: float) -> float:
        tensor = torch.tensor([value])
        dist.all_reduce(tensor, group=self.ctx.process_group)
        return float(tensor)


def test_inline_roles_get_a_size_one_group_that_shutdown_tears_down() -> None:
    if dist.is_initialized():
        pytest.fail("torch.distributed is already initialised in this test process; the test needs it clean")
    actor = create_worker_group("inline", "actor", _ContextProbe, seed=1)
    reference = create_worker_group("inline", "reference", _ContextProbe, seed=1)
    group = actor.ctx.process_group
    assert group is not None and actor.call("all_reduce", 0.0) == 0.0
    assert actor.worker.ctx.process_group is group, "the worker must see the group in its context"
    assert (dist.get_world_size(group), dist.get_rank(group), dist.get_backend(group)) == (1, 0, "gloo")
    assert actor.call("all_reduce", 3.5) == 3.5  # a collective over the group works (sum over one rank)
    actor.shutdown()
    assert actor.ctx.process_group is None
    assert reference.call("all_reduce", 2.0) == 2.0, "the other role's group must outlive the first shutdown"
    reference.shutdown()
    assert not dist.is_initialized(), "the last shutdown must tear down what the inline placement set up"


def test_a_worker_that_fails_to_build_gives_the_group_back() -> None:
    class Broken:
        def __init__(self, *, ctx: EngineContext) -> None:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        create_worker_group("inline", "actor", Broken)
    assert not dist.is_initialized()


class _DDPEngine:
    """The engine a plugin author writes from docs/plugins.md: ``shard`` wraps the module in
    ``DistributedDataParallel(module, process_group=ctx.process_group)``."""

    @hookimpl
    def build_model(self, config, ctx):  # noqa: ANN001, ANN201
        torch.manual_seed(0)
        return torch.nn.Linear(2, 1)

    @hookimpl
    def shard(self, module, config, model_config, ctx):  # noqa: ANN001, ANN201
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, process_group=ctx.process_group)

    @hookimpl
    def forward_backward(self, model, batch, loss_fn, forward_only):  # noqa: ANN001, ANN201
        loss = model(batch["x"]).sum()
        loss.backward()  # DDP all-reduces the gradients over its group here
        return StepOutput(outputs={}, metrics={"loss": float(loss.detach())})

    for _name in ("optimizer_step", "reshard_for_rollout", "save_checkpoint", "load_checkpoint"):
        exec(f"@hookimpl\ndef {_name}(self, model):\n    return None")  # noqa: S102 - required stubs


@pytest.fixture
def ddp_engine() -> Iterator[str]:
    from geartrain import plugins

    plugins.register_engine("ddp-by-hand", _DDPEngine())
    yield "ddp-by-hand"
    plugins.unregister("engine", "ddp-by-hand")


def test_a_hand_built_context_gets_the_size_one_group_and_gives_it_back(ddp_engine: str) -> None:
    """``EngineContext(role=...)`` built by hand (as docs/guide.md does) has no group; the core
    supplies the size-1 group, so the DDP line of docs/plugins.md works, and releases it
    with the engine (and the rollout, on shutdown)."""
    import gc

    from geartrain import Engine, Rollout
    from geartrain.config import EngineConfig, ModelConfig, RolloutConfig

    if dist.is_initialized():
        pytest.fail("torch.distributed is already initialised in this test process; the test needs it clean")
    engine = Engine(EngineConfig(backend=ddp_engine), ModelConfig(tiny="qwen2"), EngineContext(role="actor"))
    group = engine.ctx.process_group
    assert group is not None and engine.handle.process_group is group
    assert (dist.get_world_size(group), dist.get_backend(group)) == (1, "gloo")
    out = engine.forward_backward(Batch({"x": torch.tensor([[1.0, 2.0], [3.0, -1.0]])}))
    weight, bias = engine.handle.module.weight.detach(), engine.handle.module.bias.detach()
    assert out.metrics["loss"] == pytest.approx(float(weight @ torch.tensor([4.0, 1.0]) + 2 * bias), rel=1e-6)
    assert engine.handle.module.weight.grad.tolist() == [[4.0, 1.0]]  # the gradient, all-reduced over one rank

    rollout = Rollout(
        RolloutConfig(backend="torch", max_model_len=16), ModelConfig(tiny="qwen2"), EngineContext(role="rollout")
    )
    assert rollout.ctx.process_group is group  # one shared size-1 group per backend
    rollout.shutdown()
    assert dist.is_initialized(), "the engine still holds the group"
    del engine, out
    gc.collect()
    assert not dist.is_initialized(), "the last holder must tear down what the core set up"


def test_a_hand_built_context_for_several_ranks_needs_its_group(ddp_engine: str) -> None:
    from geartrain import Engine
    from geartrain.config import EngineConfig, ModelConfig
    from geartrain.errors import GeartrainError

    with pytest.raises(GeartrainError, match=r"world_size=2\) has no process_group: .*worker group"):
        Engine(EngineConfig(backend=ddp_engine), ModelConfig(tiny="qwen2"), EngineContext(role="actor", world_size=2))
    assert not dist.is_initialized()


# ----------------------------------------------------------------------------- metric reduction


class _FakeMetricsEngine:
    """A fake engine (it computes nothing) whose ``forward_backward`` reports fixed local
    metrics per rank, to test the core's reduction rule across ranks."""

    def __init__(self, peers: bool) -> None:
        self.peers = peers

    @hookimpl
    def build_model(self, config, ctx):  # noqa: ANN001, ANN201
        return ctx

    @hookimpl
    def shard(self, module, config, model_config, ctx):  # noqa: ANN001, ANN201
        return module

    @hookimpl
    def data_parallel_coordinates(self, model):  # noqa: ANN001, ANN201
        # peers: both ranks hold the same slice (like sequence-parallel peers)
        return (
            DataParallelCoordinates(rank=0, size=1) if self.peers else DataParallelCoordinates(rank=model.rank, size=2)
        )

    @hookimpl
    def forward_backward(self, model, batch, loss_fn, forward_only):  # noqa: ANN001, ANN201
        rank = model.rank
        if self.peers:
            return StepOutput(outputs={}, metrics={"loss": 0.75, "tokens": 10.0})
        metrics = {"loss": 0.25 * (rank + 1), "tokens": float(len(batch) * (rank + 3))}
        if rank == 1:
            metrics["only_on_rank_1"] = 2.0  # a rank may see keys the other does not
        return StepOutput(outputs={}, metrics=metrics)

    for _name in ("optimizer_step", "reshard_for_rollout", "save_checkpoint", "load_checkpoint"):
        exec(f"@hookimpl\ndef {_name}(self, model):\n    return None")  # noqa: S102 - required stubs


def _reduce_on_rank(rank: int, world: int, store_path: str, out_dir: str) -> None:
    from geartrain import Engine, register_engine
    from geartrain.config import EngineConfig, ModelConfig

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        results = {}
        for peers in (False, True):
            register_engine("fake-metrics", _FakeMetricsEngine(peers))
            ctx = EngineContext(role="actor", rank=rank, world_size=world, process_group=dist.group.WORLD)
            engine = Engine(EngineConfig(backend="fake-metrics"), ModelConfig(tiny="qwen2"), ctx)
            results[peers] = engine.forward_backward(Batch({"input_ids": torch.zeros(3, 2, dtype=torch.long)})).metrics
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_hook_data_parallel_coordinates_count_peers_once_in_metric_sums(tmp_path) -> None:  # noqa: ANN001
    """Engines report their own slice; the core sums over data-parallel ranks (peers that
    share a slice counted once) and every rank sees the same global metrics."""
    import torch.multiprocessing as mp

    mp.start_processes(
        _reduce_on_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for got in ranks:
        assert got[False] == {"loss": 0.25 + 0.5, "tokens": 3 * 3 + 3 * 4, "only_on_rank_1": 2.0}
        assert got[True] == {"loss": 0.75, "tokens": 10.0}
