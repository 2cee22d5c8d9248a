"""Optional experiment trackers next to TensorBoard: Weights & Biases and MLflow.

``trainer.loggers = ["tensorboard", "wandb", "mlflow"]`` picks them; each takes the same flat
records as :class:`~geartrain.trainer.metrics.JsonlLogger` (``phase``, ``step`` and numbers).
Their libraries are optional extras, imported only when chosen; a missing one is an error
that names the command installing it. W&B runs offline with ``trainer.wandb_mode =
"offline"`` (or ``WANDB_MODE=offline``), MLflow logs to ``<output_dir>/mlruns`` unless
``trainer.mlflow_tracking_uri`` names a server: neither needs a network then.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from geartrain.errors import GeartrainError

#: What installs each optional logger from a checkout (until the packages are published).
INSTALL = {
    "wandb": "pip install './core[wandb]'  (or: pip install wandb)",
    "mlflow": "pip install './core[mlflow]'  (or: pip install mlflow-skinny)",
}


class MetricLogger(Protocol):
    """Anything that takes the job's records."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _import(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise GeartrainError(
            f"trainer.loggers names '{name}' but it is not installed ({exc}); install it: {INSTALL[name]}"
        ) from None


def numbers(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numeric values of a record, by metric name (``phase`` and ``step`` out)."""
    out = {}
    for key, value in record.items():
        if key in ("phase", "step") or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(float(value)):
            out[key] = float(value)
    return out


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dump as dotted keys (``actor.engine.optim.lr``)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_config(value, f"{path}."))
        else:
            out[path] = value
    return out


class WandbLogger:
    """A W&B run in ``<output_dir>/wandb``; the RL and SFT steps are on the ``trainer/step``
    axis. A resumed job continues the same run (its id is derived from the output dir)."""

    def __init__(
        self, output_dir: Path, *, project: str, name: str, config: Mapping[str, Any], mode: str | None, resume: bool
    ) -> None:
        wandb = _import("wandb")
        run_id = hashlib.sha1(str(output_dir.resolve()).encode()).hexdigest()[:12]
        self.run = wandb.init(
            project=project,
            name=name,
            id=run_id,
            dir=str(output_dir),
            config=dict(config),
            mode=mode,
            resume="allow" if resume else None,
            reinit="finish_previous",
        )
        self.run.define_metric("trainer/step")
        self.run.define_metric("*", step_metric="trainer/step")

    def write(self, record: dict[str, Any]) -> None:
        values = numbers(record)
        if values:
            self.run.log({**values, "trainer/step": int(record.get("step", 0))})

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    """An MLflow run in experiment ``project``, at ``tracking_uri`` (default: the local
    store ``<output_dir>/mlruns``); the config as parameters, every number as a metric."""

    def __init__(
        self, output_dir: Path, *, project: str, name: str, config: Mapping[str, Any], tracking_uri: str | None
    ) -> None:
        self.mlflow = _import("mlflow")
        if tracking_uri is None:
            # the local file store needs no server or database (mlflow-skinny has no SQL);
            # MLflow 3 asks for this opt-in to keep using it
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.mlflow.set_tracking_uri(tracking_uri or (output_dir.resolve() / "mlruns").as_uri())
        self.mlflow.set_experiment(project)
        self.run = self.mlflow.start_run(run_name=name)
        params = {k: str(v)[:500] for k, v in flat_config(config).items()}
        items = list(params.items())
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per call
            self.mlflow.log_params(dict(items[i : i + 100]))

    def write(self, record: dict[str, Any]) -> None:
        values = numbers(record)
        if values:
            self.mlflow.log_metrics(values, step=int(record.get("step", 0)))

    def close(self) -> None:
        self.mlflow.end_run()


class Fanout:
    """Several loggers as one."""

    def __init__(self, loggers: list[Any]) -> None:
        self.loggers = loggers

    def write(self, record: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.write(record)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
