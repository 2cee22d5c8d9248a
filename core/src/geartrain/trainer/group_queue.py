"""The separate rollout's stream of finished GRPO groups (``algorithm.max_staleness >= 1``).

Requests (a loader batch of prompts each) go to the rollout replicas ahead of training; as
their samples come back each prompt's ``n`` samples form a :class:`Group`, kept whole, that
is *finished* at its longest sample's time (``ready_at``). The trainer takes a batch of the
first ``batch_groups`` finished groups (whatever request they came from), so one long
sample no longer holds a whole step; a group whose weights are more than ``max_staleness``
versions older than the trainer's is dropped (and counted) instead of trained on.

At most ``capacity`` groups are outstanding (sent and neither trained nor dropped): the
queue is bounded, and so is the work the replicas hold. Taking the first finished groups
biases a step towards short responses (they finish first), more so with a heavier tail and
a larger ``capacity``; long responses are trained on later (staler) or, past the bound,
dropped. See the ``algorithm.max_staleness`` docs.

Pure bookkeeping (no Ray, no clock of its own): :class:`~geartrain.trainer.separate.SeparateGeneration`
sends the requests and feeds the results in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from geartrain.batch import Batch
from geartrain.data import PromptBatch


@dataclass(kw_only=True)
class Group:
    """One prompt's samples, kept whole."""

    request: int
    """The number of the request it came from (sending order)."""
    index: int
    """The prompt's place in that request."""
    prompt: PromptBatch
    """The prompt (one row)."""
    rows: Batch
    version: int
    """The version of the weights that generated it."""
    ready_at: float
    """When it finished (its longest sample), ``time.time()``."""


@dataclass(kw_only=True)
class _Request:
    prompts: PromptBatch
    loader_state: dict[str, Any]
    left: int
    """Groups neither trained nor dropped yet."""


class GroupQueue:
    """Outstanding requests and their finished groups (see the module docstring)."""

    def __init__(self, *, batch_groups: int, max_staleness: int, capacity: int) -> None:
        if capacity < batch_groups:
            raise ValueError(f"capacity ({capacity} groups) below one batch ({batch_groups} groups)")
        self.batch_groups, self.max_staleness, self.capacity = batch_groups, max_staleness, capacity
        self.requests: dict[int, _Request] = {}
        self.finished: list[Group] = []
        self.dropped = 0
        """Groups dropped as too stale, in total."""

    @property
    def outstanding(self) -> int:
        """Groups sent and neither trained nor dropped."""
        return sum(r.left for r in self.requests.values())

    def has_room(self, groups: int) -> bool:
        """Whether ``groups`` more can be sent within ``capacity``."""
        return self.outstanding + groups <= self.capacity

    def sent(self, number: int, prompts: PromptBatch, loader_state: dict[str, Any]) -> None:
        """Request ``number`` (``prompts``; the loader's state before them) was sent."""
        self.requests[number] = _Request(prompts=prompts, loader_state=loader_state, left=len(prompts))

    def add(self, groups: list[Group]) -> None:
        """Groups of a sent request came back (each is finished at its ``ready_at``)."""
        for group in groups:
            if group.request not in self.requests:
                raise KeyError(f"group of request {group.request}, which was not sent or is consumed")
        self.finished.extend(groups)

    def _consume(self, group: Group) -> None:
        request = self.requests[group.request]
        request.left -= 1
        if request.left == 0:
            del self.requests[group.request]

    def drop_stale(self, version: int) -> int:
        """Drop the finished groups more than ``max_staleness`` versions behind ``version``
        (the trainer's now); returns how many."""
        stale = [g for g in self.finished if version - g.version > self.max_staleness]
        self.finished = [g for g in self.finished if version - g.version <= self.max_staleness]
        for group in stale:
            self._consume(group)
        self.dropped += len(stale)
        return len(stale)

    def first_finished(self) -> list[Group]:
        """The ``batch_groups`` groups that finish first (fewer if fewer came back)."""
        return sorted(self.finished, key=lambda g: (g.ready_at, g.request, g.index))[: self.batch_groups]

    def take(self, version: int) -> list[Group]:
        """Remove and return the first finished batch for a trainer at ``version`` (stale
        groups dropped first), in sending order. Raises ``LookupError`` if fewer than
        ``batch_groups`` fresh groups came back."""
        self.drop_stale(version)
        batch = self.first_finished()
        if len(batch) < self.batch_groups:
            raise LookupError(f"{len(batch)} fresh groups finished, a batch needs {self.batch_groups}")
        chosen = {id(g) for g in batch}
        self.finished = [g for g in self.finished if id(g) not in chosen]
        for group in batch:
            self._consume(group)
        return sorted(batch, key=lambda g: (g.request, g.index))

    def loader_state(self) -> dict[str, Any] | None:
        """The loader's state before the oldest request with groups not trained yet (a
        checkpoint resumes there; groups of it that were trained are trained again),
        ``None`` when nothing is outstanding."""
        return self.requests[min(self.requests)].loader_state if self.requests else None
