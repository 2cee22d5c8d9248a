"""Where roles run: worker groups of ranks, behind one interface.

Every call the trainer makes on a role (actor, rollout, reference, critic, reward) goes
through :class:`WorkerGroup`. Two placements create them: ``inline`` (one rank, in the
driver process) and ``ray`` (each rank a Ray actor; :mod:`geartrain.cluster.ray_placement`,
needs the ``geartrain[ray]`` extra). :mod:`geartrain.cluster.dispatch` splits batches across
data-parallel ranks and gathers results back in order.
"""

from geartrain.cluster.placement import make_placement
from geartrain.cluster.worker_group import (
    Dispatch,
    InlinePlacement,
    InlineWorkerGroup,
    PendingCall,
    Placement,
    WorkerGroup,
    create_worker_group,
)

__all__ = [
    "Dispatch",
    "InlinePlacement",
    "InlineWorkerGroup",
    "PendingCall",
    "Placement",
    "WorkerGroup",
    "create_worker_group",
    "make_placement",
]
