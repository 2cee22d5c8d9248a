"""Placement-invariant sampling streams and the placement checks of a job's config."""

from __future__ import annotations

import pytest
from geartrain.errors import ConfigError
from geartrain.seeding import prompt_indices, sample_seed
from geartrain.trainer.config import load_train_config


def test_sample_seeds_are_distinct_and_stable() -> None:
    seeds = {sample_seed(7, i, j) for i in range(64) for j in range(16)}
    assert len(seeds) == 64 * 16
    assert all(0 <= s < 2**63 for s in seeds)
    assert sample_seed(7, 3, 1) == sample_seed(7, 3, 1) != sample_seed(8, 3, 1)
    # the (prompt, sample) grid is not a line: swapping the indices gives another stream
    assert sample_seed(7, 1, 2) != sample_seed(7, 2, 1)


def test_prompt_indices_default_and_mismatch() -> None:
    assert prompt_indices(None, 3) == [0, 1, 2]
    assert prompt_indices([5, 2], 2) == [5, 2]
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        prompt_indices([0, 1], 3)


def _load(*overrides: str):  # noqa: ANN202
    return load_train_config(None, list(overrides), check_plugins=False)


def test_inline_refuses_more_than_one_rank() -> None:
    with pytest.raises(ConfigError) as info:
        _load("actor.engine.parallel.dp=2", "actor.engine.parallel.sp=2")
    text = str(info.value)
    assert "actor.engine.parallel" in text and "= 4 ranks" in text and 'cluster.placement = "ray"' in text


def test_inline_refuses_a_multi_rank_reference() -> None:
    with pytest.raises(ConfigError, match="reference.engine.parallel"):
        _load("algorithm.use_kl_loss=true", "reference.engine.parallel.tp=2")


def test_ray_needs_colocated_roles_on_the_actors_ranks() -> None:
    assert _load("cluster.placement=ray", "actor.engine.parallel.dp=2").cluster.placement == "ray"
    with pytest.raises(ConfigError) as info:
        _load("cluster.placement=ray", "actor.engine.parallel.dp=2", "algorithm.use_kl_loss=true")
    assert "reference.engine.parallel" in str(info.value) and "make the product 2" in str(info.value)
    # a role with ranks of its own may have any size
    _load("cluster.placement=ray", "actor.engine.parallel.dp=2", "algorithm.use_kl_loss=true", "cluster.colocate=[]")


def test_tensor_uniforms_equal_the_reference_bit_for_bit() -> None:
    import torch
    from geartrain.seeding import sample_seed, uniform, uniforms

    seeds = [sample_seed(s, p, j) for s in (0, 7, 2**40 + 3) for p in (0, 1, 99) for j in (0, 5)]
    seeds += [0, 1, 2**63 - 1]
    for counter in (0, 1, 4, 2**33 + 1):
        got = uniforms(torch.tensor(seeds, dtype=torch.int64), counter).tolist()
        want = [uniform(s, counter) for s in seeds]
        assert got == want
        # the counter as a device tensor (what a CUDA-graphed decode step advances) draws the same
        assert uniforms(torch.tensor(seeds, dtype=torch.int64), torch.tensor(counter)).tolist() == want
        assert all(0.0 <= u < 1.0 for u in got)
    # streams are distinct across seeds and counters, and roughly uniform
    many = uniforms(torch.arange(20000, dtype=torch.int64) * 7919, 3)
    assert abs(float(many.mean()) - 0.5) < 0.01 and len(set(many.tolist())) == 20000
    assert not torch.equal(uniforms(torch.tensor([5]), 0), uniforms(torch.tensor([5]), 1))
