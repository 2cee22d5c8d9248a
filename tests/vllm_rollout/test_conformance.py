"""The vLLM rollout against geartrain's rollout conformance suite (real vLLM, CPU, fp32)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from geartrain.testing.rollout_suite import RolloutConformance  # noqa: E402
from geartrain_vllm.engine import CPU_TINY_OVERRIDES  # noqa: E402


class TestVllmConformance(RolloutConformance):
    backend = "vllm"
    # fp32 vLLM vs fp32 transformers: different kernels and summation orders.
    logprob_atol = 1e-4
    # 32-token KV blocks (the CPU default is 128, longer than the suite's sequences): the
    # multi-turn tests then find their prefixes in vLLM's prefix cache.
    options = {"seed": 0, "engine_kwargs": {"block_size": 32}}
    # vLLM's CPU attention has no kernel for the tiny models' head size 16: the suite's
    # models (and its references) get 2 heads of 32.
    model_overrides = CPU_TINY_OVERRIDES
