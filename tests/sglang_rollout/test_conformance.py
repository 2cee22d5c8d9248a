"""The SGLang rollout against geartrain's rollout conformance suite (real SGLang Engine, CPU, fp32)."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

from geartrain.testing.rollout_suite import RolloutConformance  # noqa: E402


class TestSglangConformance(RolloutConformance):
    backend = "sglang"
    # fp32 SGLang (torch_native attention) vs fp32 transformers: different kernels and
    # summation orders (measured: < 1e-6).
    logprob_atol = 1e-4
    options = {"seed": 0}
