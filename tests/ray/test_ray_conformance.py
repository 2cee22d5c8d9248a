"""The fsdp engine passes the engine conformance suite on 2 Ray ranks: data parallel and
Ulysses sequence parallel (geartrain.testing's multi-rank mode)."""

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
