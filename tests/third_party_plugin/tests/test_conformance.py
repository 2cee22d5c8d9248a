"""The third-party engine runs geartrain's engine conformance suite, supplying only its name."""

from geartrain.testing.engine_suite import EngineConformance


class TestSimpleEngineConformance(EngineConformance):
    backend = "simple"
