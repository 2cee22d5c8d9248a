"""What a run shows (issue 19, item 13): warnings on lines of their own above the progress
bar, one TensorBoard tag per SFT metric (sft/loss, not sft/sft/loss), and curves without the
series that are 0 by construction."""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path

import pytest
from geartrain.trainer.metrics import Progress, TensorBoardLogger, TqdmLoggingHandler, plotted


def test_a_warning_during_the_bar_gets_its_own_line(monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    handler = TqdmLoggingHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("geartrain.test_bar")
    log.addHandler(handler)
    log.propagate = False
    try:
        bar = Progress(10, 0, "grpo", True)
        bar.update(reward=0.5, train_acc=0.25)
        log.warning("the reward timed out")
        bar.update(reward=0.6, train_acc=0.5)
        bar.close()
    finally:
        log.removeHandler(handler)
    lines = [part for line in err.getvalue().split("\n") for part in line.split("\r")]
    warning = [line for line in lines if "the reward timed out" in line]
    assert warning == ["WARNING geartrain.test_bar: the reward timed out"], lines
    assert any("train_acc=" in line for line in lines)


def test_sft_metrics_have_one_tensorboard_prefix(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = TensorBoardLogger(tmp_path)
    tb.write({"phase": "sft", "step": 1, "sft/loss": 0.5, "sft/grad_norm": 1.0})
    tb.write({"phase": "rl", "step": 1, "reward/mean": 0.25})
    tb.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["reward/mean", "sft/grad_norm", "sft/loss"]


def test_curves_leave_out_series_that_are_zero_throughout() -> None:
    records = [
        {
            "step": s,
            "reward/mean": s / 4,
            "actor/kl_loss": 0.0,
            "actor/ppo_kl": 0.0,
            "actor/entropy": 2.0 - s / 10,
            "timing/weight_sync_s": 0.0,
            "timing/generate_s": 0.1,
        }
        for s in range(4)
    ]
    panels = dict(plotted(records))
    assert panels["KL / entropy"] == ["actor/entropy"]
    assert panels["seconds per phase"] == ["timing/generate_s"]
    assert "grad norm" not in panels and "validation accuracy" not in panels
