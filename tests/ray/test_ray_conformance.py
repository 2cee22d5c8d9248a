"""The fsdp engine (data parallel, Ulysses sequence parallel) and the megatron engine (tensor
parallel, pipeline parallel) pass the engine conformance suite on 2 Ray ranks
(geartrain.testing's multi-rank mode)."""

from __future__ import annotations

import pytest
from geartrain.testing.engine_suite import EngineConformance

pytestmark = [pytest.mark.slow]


class TestFSDPOnTwoDataParallelRanks(EngineConformance):
    backend = "fsdp"
    parallel = {"dp": 2}
    families = ("qwen2",)


class TestFSDPOnTwoSequenceParallelRanks(EngineConformance):
    backend = "fsdp"
    parallel = {"sp": 2}
    families = ("llama",)


class TestMegatronOnTwoTensorParallelRanks(EngineConformance):
    """megatron TP2: both ranks hold one replica (one data-parallel slice), each half of
    every layer and of the vocabulary."""

    backend = "megatron"
    parallel = {"tp": 2}
    families = ("qwen2",)


class TestMegatronOnTwoPipelineStages(EngineConformance):
    """megatron PP2: the first stage has no outputs of its own (the last stage's are
    broadcast) and holds no loss; the untied output layer lives on the last stage."""

    backend = "megatron"
    parallel = {"pp": 2}
    families = ("llama",)
