"""Tools for testing geartrain backends: the conformance suites a plugin's tests subclass,
the recording fakes that test the core's own plumbing, and (re-exported from
:mod:`geartrain.modeling`) the tiny models and tokenizer built in code."""

import sys
from typing import Any

from geartrain.modeling import tiny_config, tiny_model, tiny_tokenizer

if "pytest" in sys.modules:  # under pytest, the suites' bare asserts show their values, as a test module's do
    sys.modules["pytest"].register_assert_rewrite("geartrain.testing.engine_suite", "geartrain.testing.rollout_suite")

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
