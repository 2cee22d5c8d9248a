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
    assert "grad norm" not in panels and "accuracy" not in panels


def _noisy_run(steps: int = 40) -> list[dict]:
    """A run whose validation accuracy is 0 throughout, with two reward functions, a noisy
    reward and training accuracy between 0.992 and 1."""
    records = [{"phase": "rl", "step": 0, "val/accuracy": 0.0, "val/reward_mean": 0.1}]
    for s in range(1, steps + 1):
        noise = 0.3 if s % 2 else -0.3
        records.append(
            {
                "phase": "rl",
                "step": s,
                "reward/mean": s / steps + noise,
                "reward/correct/mean": 0.0,
                "reward/short/mean": -s / 10,
                "reward/accuracy": 0.992 + 0.008 * (s % 2),
                "actor/kl_loss": 0.0,
            }
        )
        if s % 10 == 0:
            records[-1].update({"val/accuracy": 0.0, "val/reward_mean": s / steps})
    return records


def test_curves_keep_zero_results_and_draw_each_reward_function() -> None:
    """Issue 34 item 7: a validation accuracy of 0 throughout kept its panel only when not
    0; each reward function and the validation reward have curves; a KL loss that is off
    (0 throughout) is still left out."""
    panels = dict(plotted(_noisy_run()))
    assert panels["reward"] == ["reward/mean", "reward/correct/mean", "reward/short/mean", "val/reward_mean"]
    assert panels["accuracy"] == ["reward/accuracy", "val/accuracy"]
    assert "KL / entropy" not in panels


def test_curves_smooth_noisy_series_and_draw_accuracy_from_0_to_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34 item 7: a noisy training series is drawn faint with its moving average over
    it (TensorBoard's debiased EMA); the accuracy axis is 0 to 1, not 0.992 to 1.000."""
    import matplotlib

    matplotlib.use("Agg")
    from geartrain.trainer.metrics import plot_curves, smoothed
    from matplotlib.figure import Figure

    assert smoothed([1.0, 0.0, 1.0], 0.5) == pytest.approx([1.0, 1 / 3, 5 / 7])  # (0.5 x 0.5) / 0.75 ...
    figures: list[Figure] = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (figures.append(self), save(self, *a, **k))[1])
    records = _noisy_run()
    plot_curves(records, tmp_path / "c.png")
    axes = {ax.get_title(): ax for ax in figures[0].axes if ax.get_title()}
    low, high = axes["accuracy"].get_ylim()
    assert low <= 0.0 and high >= 1.0
    lines = {line.get_label(): line for line in axes["reward"].get_lines()}
    raw = [r["reward/mean"] for r in records if "reward/mean" in r]
    assert list(lines["reward/mean"].get_ydata()) == pytest.approx(smoothed(raw))
    faint = [line for line in axes["reward"].get_lines() if list(line.get_ydata()) == pytest.approx(raw)]
    assert faint and faint[0].get_alpha() < 0.5
    assert list(lines["val/reward_mean"].get_xdata()) == [0, 10, 20, 30, 40]
    assert list(lines["reward/correct/mean"].get_ydata()) == [0.0] * 40


def test_sample_tables_escape_control_characters_from_the_data() -> None:
    """Issue 35, round 13: prompts holding escape sequences (OSC 0 retitled the terminal,
    ``ESC[2J`` cleared it, a carriage return or a right-to-left override hid text) were
    printed raw by ``trainer.print_completions``."""
    from geartrain.trainer.completions import console_table, visible

    assert visible("\x1b]0;PWNED\x07ab\r\u202ecd\nef\tg é") == "\\x1b]0;PWNED\\x07ab\\x0d\\u202ecd⏎ef g é"
    table = console_table([{"step": 1, "prompt": "\x1b[2Jab", "response": "ok\rno", "rewards": {}, "reward": 1.0}])
    assert "\x1b" not in table and "\r" not in table
    assert "\\x1b[2Jab" in table and "ok\\x0dno" in table
