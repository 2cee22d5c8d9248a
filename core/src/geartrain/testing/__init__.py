"""Tools for testing geartrain backends: the conformance suites a plugin's tests subclass,
the recording fakes that test the core's own plumbing, and (re-exported from
:mod:`geartrain.modeling`) the tiny models and tokenizer built in code."""

from typing import Any

from geartrain.modeling import tiny_config, tiny_model, tiny_tokenizer

__all__ = ["EngineConformance", "RolloutConformance", "tiny_config", "tiny_model", "tiny_tokenizer"]


def __getattr__(name: str) -> Any:
    # The suites import pytest, which only test environments have: load them on first use.
    if name == "RolloutConformance":
        from geartrain.testing.rollout_suite import RolloutConformance

        return RolloutConformance
    if name == "EngineConformance":
        from geartrain.testing.engine_suite import EngineConformance

        return EngineConformance
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
