"""DAPO dynamic sampling in the trainer: re-padding rollout batches of different widths,
and collecting informative groups with a capped number of extra rounds."""

from __future__ import annotations

import torch
from geartrain.batch import Batch
from geartrain.trainer.sampling import collect_informative, concat_rollouts


def rollout(prompts: list[list[int]], responses: list[list[int]], scores: list[float], uids: list[str]) -> Batch:
    """A batch in the core layout: left-padded prompts, right-padded responses (pad 0)."""
    width = max(len(p) for p in prompts)
    total = width + max(len(r) for r in responses)
    ids = torch.zeros(len(prompts), total, dtype=torch.long)
    resp = torch.zeros(len(prompts), total, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, width - len(p) : width] = torch.tensor(p)
        ids[i, width : width + len(r)] = torch.tensor(r)
        resp[i, width : width + len(r)] = 1
    return Batch(
        {"input_ids": ids, "response_mask": resp, "attention_mask": (ids != 0).long()},
        meta={"score": scores, "uid": uids, "correct": scores},
        info={"prompt_length": width},
    )


def test_concat_rollouts_repads_prompt_and_response_parts():
    a = rollout([[1, 2]], [[3]], [1.0], ["a"])  # prompt width 2, response width 1
    b = rollout([[4]], [[5, 6, 7]], [0.0], ["b"])  # prompt width 1, response width 3
    out = concat_rollouts([a, b])
    assert out.info["prompt_length"] == 2
    assert out["input_ids"].tolist() == [[1, 2, 3, 0, 0], [0, 4, 5, 6, 7]]
    assert out["response_mask"].tolist() == [[0, 0, 1, 0, 0], [0, 0, 1, 1, 1]]
    assert out["uid"] == ["a", "b"] and out["score"] == [1.0, 0.0]


def test_collect_informative_refills_and_logs_the_rounds():
    # round 0: group a informative, b all-equal; round 1: c all-equal; round 2: d and e informative
    first = rollout([[1]] * 4, [[9]] * 4, [1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"])
    more = {
        1: rollout([[2]] * 2, [[9, 9]] * 2, [0.0, 0.0], ["c", "c"]),
        2: rollout([[3, 3]] * 4, [[9]] * 4, [0.0, 1.0, 1.0, 0.5], ["d", "d", "e", "e"]),
    }
    calls = []
    batch, metrics = collect_informative(
        first, lambda r: calls.append(r) or more[r], target_groups=2, max_extra_rounds=4
    )
    assert calls == [1, 2]
    # a from round 0, d from round 2; e is the surplus and is cut
    assert batch["uid"] == ["a", "a", "d", "d"]
    assert batch["score"] == [1.0, 0.0, 0.0, 1.0]
    assert batch["input_ids"].shape == (4, 3)
    assert metrics == {
        "dynamic_sampling/dropped_groups": 2.0,
        "dynamic_sampling/refilled_groups": 1.0,
        "dynamic_sampling/extra_rounds": 2.0,
        "dynamic_sampling/kept_groups": 2.0,
        "dynamic_sampling/short": 0.0,
    }


def test_collect_informative_stops_at_the_cap():
    first = rollout([[1]] * 2, [[9]] * 2, [1.0, 1.0], ["a", "a"])
    dull = rollout([[2]] * 2, [[9]] * 2, [0.0, 0.0], ["b", "b"])
    calls = []
    batch, metrics = collect_informative(first, lambda r: calls.append(r) or dull, target_groups=1, max_extra_rounds=2)
    assert calls == [1, 2]
    # nothing informative at all: the first batch, unfiltered, and the shortfall is logged
    assert batch is first
    assert metrics["dynamic_sampling/short"] == 1.0 and metrics["dynamic_sampling/extra_rounds"] == 2.0
    assert metrics["dynamic_sampling/dropped_groups"] == 3.0


def test_a_step_with_fewer_samples_than_mini_batches_steps_once_per_sample() -> None:
    """Issue 35, round 13: when dynamic sampling kept fewer samples than
    ``algorithm.mini_batches``, the empty mini-batches still stepped the optimizer (88 of 128
    steps in one run), moving the weights on no gradient through Adam's moments."""
    from geartrain.trainer.roles import plan_mini_batches

    few = Batch({"x": torch.arange(3)})
    parts = plan_mini_batches(few, epochs=2, mini_batches=8, seed=0)
    assert [len(p) for p in parts] == [1, 1, 1, 1, 1, 1]
    assert sorted(int(p["x"][0]) for p in parts[:3]) == [0, 1, 2], "each epoch still covers every sample once"
    many = Batch({"x": torch.arange(16)})
    assert [len(p) for p in plan_mini_batches(many, epochs=1, mini_batches=4, seed=0)] == [4, 4, 4, 4]
