"""Where metrics go: a JSONL file, TensorBoard, a progress bar, and a PNG of the curves.

Every record is one flat dict with a ``phase`` (``"sft"`` or ``"rl"``) and a ``step``.
On resume the JSONL file is rewritten without the RL records past the checkpoint's step,
so the file never repeats or skips a step.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JsonlLogger:
    """Appends one JSON object per line to ``path``."""

    def __init__(self, path: str | Path, *, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        else:
            self.truncate_after(resume_step)
        self._file = self.path.open("a", encoding="utf-8")

    def truncate_after(self, step: int) -> None:
        """Drop the RL records with ``step > step`` (written after the checkpoint the run
        resumes from) and any cut-off last line."""
        if not self.path.exists():
            self.path.write_text("")
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut off by a kill
            if record.get("phase") == "rl" and int(record.get("step", 0)) > step:
                continue
            kept.append(line)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        tmp.replace(self.path)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            records.append(json.loads(line))
    return records


class TensorBoardLogger:
    """Scalars under ``<phase>/<name>`` against the step; ``purge_step`` drops events a
    killed run wrote past the checkpoint."""

    def __init__(self, log_dir: str | Path, *, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def write(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        phase = record.get("phase", "rl")
        for key, value in record.items():
            if key in ("step", "phase") or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if math.isfinite(float(value)):
                self.writer.add_scalar(tag(phase, key), float(value), step)

    def close(self) -> None:
        self.writer.close()


def tag(phase: str, key: str) -> str:
    """The TensorBoard tag of a metric: RL metrics by their name, SFT ones under ``sft/``
    (once: ``sft/loss`` stays ``sft/loss``)."""
    return key if phase != "sft" or key.startswith("sft/") else f"sft/{key}"


class TqdmLoggingHandler(logging.Handler):
    """Writes log records through ``tqdm.write``: a warning while a progress bar is drawn
    gets a line of its own and the bar is redrawn below it, instead of being glued onto
    the bar's line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # a handler must never raise (logging's own contract)
            self.handleError(record)


class Progress:
    """A tqdm bar on stderr with a few live numbers; silent when disabled."""

    def __init__(self, total: int, initial: int, desc: str, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=True)

    def update(self, **shown: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)
            self.bar.update(1)

    def write(self, text: str) -> None:
        """Print ``text`` on stdout above the bar (through tqdm, which redraws the bar under it)."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


#: Curves drawn in the PNG, when present: (title, metric keys).
PLOTS: list[tuple[str, list[str]]] = [
    ("reward", ["reward/mean"]),
    ("validation accuracy", ["val/accuracy"]),
    ("KL / entropy", ["actor/ppo_kl", "actor/kl_loss", "actor/entropy"]),
    ("response length", ["response/length_mean"]),
    ("grad norm", ["actor/grad_norm"]),
    (
        "seconds per phase",
        ["timing/generate_s", "timing/reward_s", "timing/log_probs_s", "timing/update_s", "timing/weight_sync_s"],
    ),
]


def plotted(records: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """The panels of :data:`PLOTS` to draw for the RL ``records``, each with the series that
    carry information: a series missing from every record, or 0 in every record (e.g.
    ``actor/kl_loss`` without a KL loss), is left out, and so is a panel left empty."""
    panels = []
    for title, keys in PLOTS:
        shown = [k for k in keys if any(r.get(k) not in (None, 0, 0.0) for r in records)]
        if shown:
            panels.append((title, shown))
    return panels


def plot_curves(records: list[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Write a PNG of the RL curves (and the SFT loss) in ``records``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rl = [r for r in records if r.get("phase") == "rl"]
    sft = [r for r in records if r.get("phase") == "sft"]
    panels = plotted(rl)
    if sft:
        panels.insert(0, ("SFT loss", ["sft/loss"]))
    cols = 3
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    for ax, (name, keys) in zip(axes.flat, panels, strict=False):
        source = sft if name == "SFT loss" else rl
        for key in keys:
            points = [(r["step"], r[key]) for r in source if r.get(key) is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o" if len(points) < 30 else None, markersize=3, label=key)
        ax.set_title(name)
        ax.set_xlabel("SFT step" if name == "SFT loss" else "RL step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
