"""The fsdp engine against the core's engine conformance suite (one rank)."""

from geartrain.testing.engine_suite import EngineConformance


class TestFSDPConformance(EngineConformance):
    backend = "fsdp"
