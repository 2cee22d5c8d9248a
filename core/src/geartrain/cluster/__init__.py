"""Where roles run: worker groups of ranks, behind one interface.

Every call the trainer makes on a role (actor, rollout, reference, critic, reward) goes
through :class:`WorkerGroup`, so a placement that runs ranks elsewhere (Ray actors) slots
in without touching the trainer. Only the ``inline`` placement exists today: one rank, in
the driver process.
"""

from geartrain.cluster.worker_group import Dispatch, InlineWorkerGroup, WorkerGroup, create_worker_group

__all__ = ["Dispatch", "InlineWorkerGroup", "WorkerGroup", "create_worker_group"]
