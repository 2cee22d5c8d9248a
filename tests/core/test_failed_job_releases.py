"""A job that fails midway gives back what its inline roles hold (issue 35, known since
round 12): the engines and this process's torch.distributed group outlived a failed
``run_job``, so the next job run in the same process (a notebook retrying, a sweep) tripped
on a process group it did not make. Whatever the error, the inline placement now shuts down
every group it made that is still up."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from geartrain.cluster import make_placement
from geartrain.testing.fakes import FakeBackends, write_fake_job
from geartrain.trainer import load_train_config, run_job
from geartrain.trainer.config import ClusterConfig
from geartrain.types import EngineContext


@pytest.fixture
def clean_process() -> Iterator[None]:
    if dist.is_initialized():
        pytest.fail("torch.distributed is already initialised in this test process; the test needs it clean")
    yield
    if dist.is_initialized():  # a failure here must not spill into the next test
        dist.destroy_process_group()


class FailsAtStep:
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        if step == self.step:
            raise RuntimeError(f"the callback's failure at step {step}")


def test_a_job_failing_midway_leaves_no_process_group_and_the_next_job_runs(
    clean_process: None, tmp_path: Path
) -> None:
    with FakeBackends().registered():
        job = write_fake_job(tmp_path, tmp_path / "first", "total_steps = 3\nexport_hf = false\nprogress = false\n")
        with pytest.raises(Exception, match="the callback's failure at step 2"):
            run_job(load_train_config(job), callbacks=[FailsAtStep(2)])
        assert not dist.is_initialized(), "the failed job's inline roles still hold the process group"

        config = load_train_config(job, ["trainer.output_dir=" + str(tmp_path / "second")])
        result = run_job(config)
    assert result.steps == 3
    assert not dist.is_initialized()


class _Probe:
    closed: list[str] = []

    def __init__(self, *, ctx: EngineContext) -> None:
        self.ctx = ctx

    def close(self) -> None:
        _Probe.closed.append(self.ctx.role)
        if self.ctx.role == "broken":
            raise RuntimeError("its close fails")


def test_closing_the_inline_placement_shuts_down_every_group_still_up(
    clean_process: None, caplog: pytest.LogCaptureFixture
) -> None:
    _Probe.closed = []
    placement = make_placement(ClusterConfig(placement="inline"))
    groups: dict[str, Any] = {role: placement.group(role, _Probe) for role in ("actor", "broken", "reference")}
    groups["reference"].shutdown()  # a job shuts some down itself: they are not closed twice
    assert dist.is_initialized()
    placement.close(graceful=False)
    assert _Probe.closed == ["reference", "broken", "actor"], "newest first, each once, past one that fails"
    assert "closing the inline broken role failed: RuntimeError: its close fails" in caplog.text
    assert not dist.is_initialized()
    placement.close()  # a second close has nothing left to do
    assert _Probe.closed == ["reference", "broken", "actor"]
