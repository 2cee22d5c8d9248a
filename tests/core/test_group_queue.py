"""The separate rollout's stream of finished GRPO groups: the first finished groups make a
batch whatever request they came from, groups are kept whole, stale ones are dropped and
counted, the queue is bounded, and a checkpoint resumes before the oldest open request."""

from __future__ import annotations

import pytest
import torch
from geartrain.batch import Batch
from geartrain.data import PromptBatch
from geartrain.data.loader import PromptRow
from geartrain.trainer.group_queue import Group, GroupQueue

N = 2  # samples per prompt


def _prompts(request: int, size: int) -> PromptBatch:
    rows = [
        PromptRow(prompt=f"p{request}.{i}", prompt_ids=[request, i], ground_truth=None, meta={}) for i in range(size)
    ]
    return PromptBatch(rows=rows, indices=[10 * request + i for i in range(size)], epoch=0)


def _groups(request: int, version: int, ready: list[float]) -> list[Group]:
    prompts = _prompts(request, len(ready))
    out = []
    for i, t in enumerate(ready):
        rows = Batch({"x": torch.full((N, 1), 10 * request + i)}, {"uid": [f"{request}.{i}"] * N})
        one = PromptBatch(rows=[prompts.rows[i]], indices=[prompts.indices[i]], epoch=0)
        out.append(Group(request=request, index=i, prompt=one, rows=rows, version=version, ready_at=t))
    return out


def _queue(capacity: int = 8, k: int = 1) -> GroupQueue:
    return GroupQueue(batch_groups=3, max_staleness=k, capacity=capacity)


def test_a_batch_is_the_first_finished_groups_across_requests_in_sending_order() -> None:
    q = _queue()
    q.sent(0, _prompts(0, 4), {"at": 0})
    q.sent(1, _prompts(1, 4), {"at": 4})
    q.add(_groups(0, 0, [5.0, 0.1, 9.0, 0.3]))  # two long samples in request 0
    q.add(_groups(1, 0, [0.2, 7.0, 8.0, 6.0]))
    taken = q.take(version=0)
    assert [(g.request, g.index) for g in taken] == [(0, 1), (0, 3), (1, 0)]
    assert all(len(g.rows) == N and len(set(g.rows["uid"])) == 1 for g in taken)  # whole groups
    assert q.outstanding == 5 and len(q.finished) == 5
    assert [(g.request, g.index) for g in q.take(version=0)] == [(0, 0), (1, 1), (1, 3)]


def test_groups_more_than_k_versions_old_are_dropped_and_counted() -> None:
    q = _queue(k=1)
    q.sent(0, _prompts(0, 3), {"at": 0})
    q.sent(1, _prompts(1, 3), {"at": 3})
    q.add(_groups(0, 0, [0.1, 0.2, 0.3]))  # version 0: too old for a trainer at version 2
    q.add(_groups(1, 1, [0.4, 0.5, 0.6]))
    taken = q.take(version=2)
    assert {g.request for g in taken} == {1} and all(2 - g.version <= 1 for g in taken)
    assert q.dropped == 3 and q.outstanding == 0 and q.requests == {}


def test_too_few_fresh_groups_is_a_lookup_error_not_a_short_batch() -> None:
    q = _queue()
    q.sent(0, _prompts(0, 3), {"at": 0})
    q.add(_groups(0, 0, [0.1, 0.2, 0.3])[:2])
    with pytest.raises(LookupError, match="2 fresh groups finished, a batch needs 3"):
        q.take(version=0)


def test_the_queue_is_bounded_by_its_capacity() -> None:
    q = _queue(capacity=6)
    assert q.has_room(3)
    q.sent(0, _prompts(0, 3), {"at": 0})
    q.sent(1, _prompts(1, 3), {"at": 3})
    assert not q.has_room(3) and q.outstanding == 6
    q.add(_groups(0, 0, [0.1, 0.2, 0.3]))
    q.take(version=0)
    assert q.has_room(3)
    with pytest.raises(ValueError, match="below one batch"):
        GroupQueue(batch_groups=3, max_staleness=1, capacity=2)


def test_a_checkpoint_resumes_before_the_oldest_request_not_fully_trained() -> None:
    q = _queue(capacity=9)
    assert q.loader_state() is None
    for r in range(3):
        q.sent(r, _prompts(r, 3), {"at": 3 * r})
    q.add(_groups(1, 0, [0.1, 0.2, 0.3]))
    q.take(version=0)  # request 1 trained whole, requests 0 and 2 still out
    assert q.loader_state() == {"at": 0}
    q.add(_groups(0, 0, [0.4, 0.5, 0.6]))
    q.take(version=0)
    assert q.loader_state() == {"at": 6}
    q.add(_groups(2, 0, [0.7, 0.8, 0.9]))
    q.take(version=0)
    assert q.loader_state() is None and q.outstanding == 0
