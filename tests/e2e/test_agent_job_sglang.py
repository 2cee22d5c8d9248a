"""The agentic main job with the SGLang rollout (real sglang.Engine, CPU recipe) running the
episodes' turns (see agent_backends.py for what it must show). Runs in .venvs/sglang with
the FSDP engine added (make test-sglang-e2e)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("geartrain_sglang")
pytest.importorskip("geartrain_fsdp")
pytest.importorskip("sglang")

from agent_backends import check_agent_job_learns  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.timeout(1500)
def test_agent_job_with_the_sglang_rollout_learns(tmp_path: Path) -> None:
    # 20 GRPO steps, not the vLLM test's 50: SGLang's CPU engine takes 6 s a step here
    # (many small generate calls, one per batch of ready episodes, each crossing to the
    # scheduler process) against about 1 s for vLLM in-process; 50 steps ran past 15 min
    # at load 10.
    check_agent_job_learns("sglang", tmp_path / "agent", steps=20, min_gain=15.0)
