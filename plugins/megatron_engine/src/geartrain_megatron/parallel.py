"""megatron-core's parallel state (TP, PP, virtual PP, DP groups and the model-parallel RNG
tracker) from the ranks the worker group gives a role.

megatron-core keeps its process groups in module-level state, built over the default
process group's ranks in its ``tp-cp-ep-dp-pp`` order (tensor-parallel ranks adjacent,
pipeline stages furthest apart). So one process holds one layout: every megatron engine in
a process (actor, reference, critic) must ask for the same sizes, and the role must span
all ranks of the default group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from geartrain.config import ParallelConfig
from geartrain.types import EngineContext

from geartrain_megatron.compat import cpu_compat


@dataclass(kw_only=True, slots=True, frozen=True)
class Layout:
    """Sizes of one megatron layout and where this rank sits in it."""

    tp: int
    pp: int
    vpp: int | None
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    world: int
    ep: int = 1
    """Expert-parallel size (MoE experts split over this many data-parallel ranks)."""

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def check_sizes(parallel: ParallelConfig, world_size: int) -> None:
    """Raise ``ValueError`` naming the field when ``parallel`` cannot run on ``world_size`` ranks."""
    if parallel.sp != 1:
        raise ValueError(
            "parallel.sp: the megatron engine has no sequence/context parallelism on this build "
            "(megatron's sequence parallel needs TransformerEngine or Apex norms on a GPU); use parallel.tp"
        )
    product = parallel.dp * parallel.tp * parallel.pp
    if product != world_size:
        raise ValueError(
            f"parallel: dp * tp * pp = {parallel.dp} * {parallel.tp} * {parallel.pp} = {product}, "
            f"but the role has {world_size} ranks"
        )
    if parallel.vpp is not None and parallel.vpp > 1 and parallel.pp == 1:
        raise ValueError("parallel.vpp: virtual pipeline stages need parallel.pp > 1")


def _ensure_process_group(ctx: EngineContext) -> None:
    if dist.is_available() and dist.is_initialized():
        if ctx.process_group is not None and dist.get_world_size(ctx.process_group) != dist.get_world_size():
            raise ValueError(
                "the megatron engine builds its groups over the whole default process group: the role's "
                f"group has {dist.get_world_size(ctx.process_group)} of {dist.get_world_size()} ranks"
            )
        if dist.get_world_size() != ctx.world_size:
            raise ValueError(
                f"the context says {ctx.world_size} ranks but torch.distributed has {dist.get_world_size()}"
            )
        return
    if ctx.world_size != 1:
        raise RuntimeError("torch.distributed must be initialised by the worker group for more than one rank")
    # one rank, no process group (the inline placement): megatron still needs one
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def setup(parallel: ParallelConfig, ctx: EngineContext, *, ep: int = 1) -> Layout:
    """Initialise (or reuse) megatron's parallel state for ``parallel`` on the role's
    ranks (``ep``: expert-parallel size, carved out of the data-parallel ranks) and seed
    the model-parallel RNG tracker from ``ctx.seed``."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    check_sizes(parallel, ctx.world_size)
    if parallel.dp % ep:
        raise ValueError(
            f"options.expert_parallel={ep} must divide parallel.dp={parallel.dp} (experts split over DP ranks)"
        )
    vpp = parallel.vpp if parallel.vpp and parallel.vpp > 1 else None
    _ensure_process_group(ctx)
    with cpu_compat():
        if ps.model_parallel_is_initialized():
            have = (
                ps.get_tensor_model_parallel_world_size(),
                ps.get_pipeline_model_parallel_world_size(),
                ps.get_virtual_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size(),
            )
            if have != (parallel.tp, parallel.pp, vpp, ep):
                raise ValueError(
                    f"parallel: this process already runs megatron with tp={have[0]}, pp={have[1]}, vpp={have[2]}; "
                    f"every megatron engine in one process must use the same layout (asked tp={parallel.tp}, "
                    f"pp={parallel.pp}, vpp={vpp}, expert_parallel={ep})"
                )
        else:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=parallel.tp,
                pipeline_model_parallel_size=parallel.pp,
                virtual_pipeline_model_parallel_size=vpp,
                expert_model_parallel_size=ep,
            )
            tensor_parallel.model_parallel_cuda_manual_seed(ctx.seed)
        return current_layout()


def current_layout() -> Layout:
    from megatron.core import parallel_state as ps

    return Layout(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        world=dist.get_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
    )


def groups() -> dict[str, Any]:
    """megatron's process groups by short name."""
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(),
        "dp": ps.get_data_parallel_group(),
        "mp": ps.get_model_parallel_group(),
    }


def all_reduce_(tensor: torch.Tensor, group: Any, op: Any = None) -> torch.Tensor:
    """In-place all-reduce over ``group`` (a no-op for a group of one)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=group)
    return tensor
