"""The vLLM rollout against geartrain's rollout conformance suite (real vLLM, CPU, fp32)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("vllm")

from geartrain.config import ModelConfig  # noqa: E402
from geartrain.rollout import Rollout  # noqa: E402
from geartrain.testing.rollout_suite import RolloutConformance, named_tensors  # noqa: E402
from geartrain.testing.tiny import tiny_model  # noqa: E402
from geartrain.types import EngineContext  # noqa: E402
from geartrain_vllm.engine import CPU_TINY_OVERRIDES  # noqa: E402


class TestVllmConformance(RolloutConformance):
    backend = "vllm"
    # fp32 vLLM vs fp32 transformers: different kernels and summation orders.
    logprob_atol = 1e-4
    options = {"seed": 0}

    # vLLM's CPU attention has no kernel for the tiny models' head size 16, so the suite's
    # fixtures are replaced (fixtures, not tests) by ones whose models have 2 heads of 32.
    @pytest.fixture(scope="class")
    def reference(self, family: str) -> torch.nn.Module:
        return tiny_model(family, seed=0, **CPU_TINY_OVERRIDES[family])

    @pytest.fixture(scope="class")
    def other_reference(self, family: str) -> torch.nn.Module:
        return tiny_model(family, seed=1, **CPU_TINY_OVERRIDES[family])

    @pytest.fixture(scope="class")
    def rollout(self, family: str, reference: torch.nn.Module) -> Iterator[Rollout]:
        model = ModelConfig(tiny=family, seed=0, config_overrides=CPU_TINY_OVERRIDES[family])
        r = Rollout(self.rollout_config(), model, EngineContext(role="rollout"))
        r.update_weights(named_tensors(reference))
        yield r
        r.shutdown()
