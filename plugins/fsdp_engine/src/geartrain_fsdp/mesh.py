"""Device meshes of an engine instance: ``("dp", "sp")`` over the role's ranks, and the
mesh FSDP shards over (all ranks; ``(replicate, shard)`` for HSDP)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from geartrain.config import ParallelConfig
from geartrain.errors import ConfigError
from geartrain.types import EngineContext
from torch.distributed.device_mesh import DeviceMesh


@dataclass(kw_only=True, slots=True)
class Meshes:
    """Where this rank sits. ``mesh`` is ``None`` in a single, non-distributed process
    (the engine then runs the plain module, without FSDP)."""

    device: torch.device
    world: int
    dp: int
    sp: int
    dp_rank: int
    sp_rank: int
    mesh: DeviceMesh | None = None
    fsdp_mesh: DeviceMesh | None = None
    dp_group: Any = None
    sp_group: Any = None
    ctx_group: Any = None
    """The role's whole group (``EngineContext.process_group``)."""

    @property
    def distributed(self) -> bool:
        return self.mesh is not None


def device_of(ctx: EngineContext) -> torch.device:
    if ctx.device == "cpu":
        return torch.device("cpu")
    return torch.device(ctx.device, ctx.local_rank)


def build_meshes(
    parallel: ParallelConfig, ctx: EngineContext, hsdp_replicate: int = 1, *, shard_one_rank: bool = False
) -> Meshes:
    """The ``("dp", "sp")`` mesh over the role's ranks (``world = dp * sp``) and the FSDP
    mesh, both built from the ranks of ``ctx.process_group`` (the group the worker group
    provides; the engine creates no world of its own). On one rank the engine runs the plain
    module and needs no mesh, unless ``shard_one_rank`` (FSDP2's CPU offload on one GPU):
    then a one-rank mesh over ``ctx.process_group``."""
    device = device_of(ctx)
    dp, sp = parallel.dp, parallel.sp
    if parallel.tp != 1 or parallel.pp != 1:
        raise ConfigError(
            [("parallel", "the fsdp engine has no tensor/pipeline parallelism (parallel.tp and parallel.pp must be 1)")]
        )
    world = ctx.world_size
    if dp * sp != world:
        raise ConfigError(
            [("parallel", f"parallel.dp * parallel.sp = {dp * sp} but the worker group has {world} ranks")]
        )
    if world == 1 and shard_one_rank and ctx.process_group is None:
        raise ConfigError(
            [
                (
                    "options.cpu_offload",
                    "FSDP2's CPU offload on one rank needs the role's process group (a training job provides one; "
                    "in code pass EngineContext(process_group="
                    "geartrain.cluster.process_group.acquire_single_rank_group(device)))",
                )
            ]
        )
    if world == 1 and not shard_one_rank:
        if hsdp_replicate != 1:
            raise ConfigError([("options.hsdp_replicate", "needs more than one rank")])
        return Meshes(device=device, world=1, dp=1, sp=1, dp_rank=0, sp_rank=0, ctx_group=ctx.process_group)
    if world % hsdp_replicate:
        raise ConfigError([("options.hsdp_replicate", f"{hsdp_replicate} does not divide the {world} ranks")])
    if ctx.process_group is None:
        raise ValueError(
            f"role '{ctx.role}' runs on {world} ranks but its EngineContext has no process_group; "
            "the worker group must provide the role's group"
        )
    dev_type = device.type
    names = ("dp", "sp")
    ranks = torch.tensor(dist.get_process_group_ranks(ctx.process_group))
    if len(ranks) != world:
        raise ValueError(f"ctx.process_group has {len(ranks)} ranks, the role {world}")
    mesh = DeviceMesh(dev_type, ranks.view(dp, sp), mesh_dim_names=names)
    fsdp_mesh = (
        DeviceMesh(dev_type, ranks.view(hsdp_replicate, -1), mesh_dim_names=("replicate", "shard"))
        if hsdp_replicate > 1
        else DeviceMesh(dev_type, ranks, mesh_dim_names=("fsdp",))
    )
    coords = mesh.get_coordinate()
    assert coords is not None
    return Meshes(
        device=device,
        world=world,
        dp=dp,
        sp=sp,
        dp_rank=coords[0],
        sp_rank=coords[1],
        mesh=mesh,
        fsdp_mesh=fsdp_mesh,
        dp_group=mesh.get_group("dp"),
        sp_group=mesh.get_group("sp"),
        ctx_group=ctx.process_group,
    )


def all_reduce_(tensor: torch.Tensor, group: Any, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce over ``group``; a no-op outside a distributed run."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor
