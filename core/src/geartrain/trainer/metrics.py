"""Where metrics go: a JSONL file, TensorBoard, a progress bar, and a PNG of the curves.

Every record is one flat dict with a ``phase`` (``"sft"`` or ``"rl"``) and a ``step``.
On resume the JSONL file is rewritten without the RL records past the checkpoint's step,
so the file never repeats or skips a step.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from geartrain.errors import GeartrainError

logger = logging.getLogger("geartrain.metrics")


def _not_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _non_finite_paths(value: Any, path: str) -> list[str]:
    """``"path = value"`` for each non-finite float in ``value`` (dicts and lists, at any depth)."""
    if _not_finite(value):
        return [f"{path} = {value}"]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _non_finite_paths(v, f"{path}.{k}")]
    if isinstance(value, list | tuple):
        return [p for i, v in enumerate(value) for p in _non_finite_paths(v, f"{path}[{i}]")]
    return []


def _json_safe(value: Any) -> Any:
    """``value`` with every non-finite float, at any depth, as ``None``."""
    if _not_finite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


class JsonlLogger:
    """Appends one JSON object per line to ``path``. JSON has no NaN or infinity: such a
    value is written as ``null``, and the first time each metric holds one it is said in the
    log (a plugin's non-finite report must not vanish without a word)."""

    def __init__(self, path: str | Path, *, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._said_not_finite: set[str] = set()
        #: on resume: the steps up to ``resume_step`` with no RL record in the file (cut or
        #: edited by hand); a job's metrics have one for every step, a sampled log may not
        self.missing_rl_steps: list[int] = []
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
            self.missing_rl_steps = list(range(1, step + 1))
            return
        kept = []
        seen: set[int] = set()
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut off by a kill
            if record.get("phase") == "rl":
                if int(record.get("step", 0)) > step:
                    continue
                seen.add(int(record.get("step", 0)))
            kept.append(line)
        self.missing_rl_steps = [s for s in range(1, step + 1) if s not in seen]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        tmp.replace(self.path)

    def write(self, record: dict[str, Any]) -> None:
        # nested too: a completions record's reward columns (a reward's log_extra NaN was a
        # bare NaN in completions.jsonl, which JSON readers refuse)
        found = [p for k, v in record.items() for p in _non_finite_paths(v, k)]
        bad = [p for p in found if p.split(" = ")[0] not in self._said_not_finite]
        if bad:
            self._said_not_finite.update(p.split(" = ")[0] for p in bad)
            logger.warning(
                "%s, %s step %s: %s %s not finite, written as null (JSON has no NaN or infinity); said once per metric",
                self.path.name,
                record.get("phase", record.get("kind", "?")),
                record.get("step", "?"),
                ", ".join(bad[:5]) + (", ..." if len(bad) > 5 else ""),
                "is" if len(bad) == 1 else "are",
            )
        self._file.write(json.dumps(_json_safe(record), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def step_ranges(steps: list[int]) -> str:
    """``[3, 5, 6, 7]`` -> ``"3, 5-7"``."""
    runs: list[list[int]] = []
    for step in sorted(steps):
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


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

        _quiet_full_disk_in_event_writers()
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def write(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        phase = record.get("phase", "rl")
        for key, value in record.items():
            if key in ("step", "phase") or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if math.isfinite(float(value)):
                try:
                    self.writer.add_scalar(tag(phase, key), float(value), step)
                except FileNotFoundError:
                    raise GeartrainError(
                        f"TensorBoard's directory {self.writer.log_dir} was removed while the job ran"
                    ) from None

    def close(self) -> None:
        self.writer.close()


def _quiet_full_disk_in_event_writers() -> None:
    """Install (once) a ``threading.excepthook`` that leaves unprinted a full disk (ENOSPC)
    or a removed directory (ENOENT) raised in TensorBoard's event-writer thread: the writer
    keeps the error and raises it in the job's thread at its next write, where the run reports
    it in one line (a full disk; the run directory or its ``tensorboard/`` removed); printed
    by the default hook it was a traceback before that line. Every other exception, in any
    thread, goes to the hook that was there before."""
    import errno
    import threading

    previous = threading.excepthook
    if getattr(previous, "geartrain_event_writers", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        exc = args.exc_value
        writer = args.thread is not None and type(args.thread).__name__ == "_AsyncWriterThread"
        if writer and isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.ENOENT):
            return
        previous(args)

    hook.geartrain_event_writers = True  # type: ignore[attr-defined]
    threading.excepthook = hook


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


#: Curves drawn in the PNG, when present: (title, metric keys). The reward panel also gets
#: each reward function's ``reward/<name>/mean`` (see :func:`plotted`).
PLOTS: list[tuple[str, list[str]]] = [
    ("reward", ["reward/mean", "val/reward_mean"]),
    ("accuracy", ["reward/accuracy", "val/accuracy"]),
    ("KL / entropy", ["actor/ppo_kl", "actor/kl_loss", "actor/entropy"]),
    ("response length", ["response/length_mean"]),
    ("grad norm", ["actor/grad_norm"]),
    (
        "seconds per phase",
        ["timing/generate_s", "timing/reward_s", "timing/log_probs_s", "timing/update_s", "timing/weight_sync_s"],
    ),
]

#: Series that are 0 throughout when their feature is off (no KL loss, one PPO epoch, no
#: weight sync): left out then. Any other series is drawn even when it is 0 throughout (an
#: accuracy of 0 is a result).
OFF_WHEN_ZERO = frozenset({"actor/ppo_kl", "actor/kl_loss", "timing/weight_sync_s"})

#: Panels whose values are fractions: their y axis is 0 to 1, not autoscaled to the data's
#: range (which drew 0.992 to 1.000 as a cliff).
FRACTION_PANELS = frozenset({"accuracy"})

#: A training series with at least this many points is drawn faint with its smoothed curve
#: over it (an exponential moving average, TensorBoard's, debiased).
SMOOTH_FROM = 20
SMOOTHING = 0.8

_TERM_MEAN = re.compile(r"^reward/(.+)/mean$")


def plotted(records: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """The panels of :data:`PLOTS` to draw for the RL ``records``, each with its series that
    appear in some record (each reward function's ``reward/<name>/mean`` in the reward panel,
    after ``reward/mean``); a series of :data:`OFF_WHEN_ZERO` that is 0 in every record is
    left out, and so is a panel left empty."""
    present = list(dict.fromkeys(k for r in records for k in r))
    terms = [k for k in present if _TERM_MEAN.match(k)]
    panels = []
    for title, keys in PLOTS:
        keys = [keys[0], *terms, *keys[1:]] if title == "reward" else keys
        shown = [
            k
            for k in keys
            if k in present and not (k in OFF_WHEN_ZERO and all(r.get(k) in (None, 0, 0.0) for r in records))
        ]
        if shown:
            panels.append((title, shown))
    return panels


def smoothed(values: Sequence[float], weight: float = SMOOTHING) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased at the start."""
    out, last, norm = [], 0.0, 0.0
    for v in values:
        last = last * weight + (1 - weight) * v
        norm = norm * weight + (1 - weight)
        out.append(last / norm)
    return out


def plot_curves(records: list[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Write a PNG of the RL curves (and the SFT loss) in ``records``: the panels of
    :func:`plotted`, noisy training series smoothed over their faint raw values, validation
    series (``val/*``, a point per validation) with markers, fractions on a 0-1 axis."""
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
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            if key.startswith("val/"):
                ax.plot(xs, ys, marker="s", markersize=4, linestyle="--", label=key)
            elif len(points) >= SMOOTH_FROM:
                (line,) = ax.plot(xs, ys, alpha=0.25, linewidth=1)
                ax.plot(xs, smoothed(ys), color=line.get_color(), label=key)
            else:
                ax.plot(xs, ys, marker="o", markersize=3, label=key)
        ax.set_title(name)
        ax.set_xlabel("SFT step" if name == "SFT loss" else "RL step")
        ax.grid(alpha=0.3)
        if name in FRACTION_PANELS:
            ax.set_ylim(-0.03, 1.03)
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
