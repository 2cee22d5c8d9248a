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


#: How long the start-up check waits for a W&B or MLflow tracking server to answer.
MLFLOW_PROBE_TIMEOUT_S = 5.0


def tracker_problems(loggers: list[str], wandb_mode: str | None, mlflow_tracking_uri: str | None) -> list[str]:
    """What would stop the chosen trackers from starting, found without starting them (no
    network call but one short request to the W&B or MLflow server): a W&B run online without
    credentials, a W&B or MLflow tracking server that does not answer within
    :data:`MLFLOW_PROBE_TIMEOUT_S`, any other MLflow store that MLflow refuses or that cannot be
    written. A job checks this before it claims its output directory, so ``--overwrite``
    deletes nothing for a logger that cannot start."""
    problems = []
    if "wandb" in loggers and _wandb_online(wandb_mode) and not _wandb_credentials():
        problems.append(
            "'wandb' runs online (trainer.wandb_mode / WANDB_MODE) but no W&B API key is configured "
            '(WANDB_API_KEY, or `wandb login`); log in, or set trainer.wandb_mode="offline"'
        )
    elif "wandb" in loggers and _wandb_online(wandb_mode):
        host = _wandb_host()
        why = _no_answer(host)
        if why is not None:  # wandb.init retries for minutes, then fails: after --overwrite deleted the run
            problems.append(
                f"'wandb' runs online but the W&B server {host} does not answer ({why}); check the network "
                '(or WANDB_BASE_URL), or set trainer.wandb_mode="offline"'
            )
    if "mlflow" in loggers and mlflow_tracking_uri and mlflow_tracking_uri.startswith(("http://", "https://")):
        why = _no_answer(mlflow_tracking_uri)
        if why is not None:
            problems.append(
                f"the MLflow tracking server trainer.mlflow_tracking_uri='{mlflow_tracking_uri}' does not answer "
                f"({why}); start it, or leave trainer.mlflow_tracking_uri unset for the local store <output_dir>/mlruns"
            )
    elif "mlflow" in loggers and mlflow_tracking_uri:
        why = _store_problem(mlflow_tracking_uri)
        if why is not None:
            problems.append(
                f"MLflow cannot use trainer.mlflow_tracking_uri='{mlflow_tracking_uri}' ({why}); give a writable "
                "file store, an http(s) server, or leave it unset for the local store <output_dir>/mlruns"
            )
    return problems


def _file_store(uri: str) -> Path | None:
    """The directory of an MLflow file store URI (``file:///dir`` or a plain path), else ``None``."""
    from urllib.parse import unquote, urlparse

    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "":
        return Path(uri)
    return None


def _store_problem(uri: str) -> str | None:
    """Why MLflow cannot open the tracking store at the non-HTTP ``uri`` (``None``: it can),
    found without writing anything: a file store's nearest existing directory must be
    writable; any other URI (``sqlite:``, ``databricks``, ...) must give MLflow a client
    (mlflow-skinny has no database stores: it refuses them here, not after ``--overwrite``)."""
    from geartrain.trainer.rundir import read_only

    if uri.split(":", 1)[0] in ("databricks", "databricks-uc"):  # before the file stores: a bare word is a path
        return _databricks_problem(uri)
    directory = _file_store(uri)
    if directory is not None:
        existing = Path(os.path.expanduser(directory)).absolute()
        while not existing.exists() and existing.parent != existing:
            existing = existing.parent
        if not existing.is_dir():
            return f"{existing} is not a directory"
        if read_only(existing) or not os.access(existing, os.W_OK | os.X_OK):
            return f"{existing} is not writable"
        return None
    try:
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri=uri)
    except Exception as exc:  # noqa: BLE001 - MLflow's own refusal, whatever its type
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"{type(exc).__name__}: {first[:300]}"
    return None


def _databricks_problem(uri: str) -> str | None:
    """Why a Databricks tracking ``uri`` cannot be used: a workspace that does not answer
    (asked before the Databricks SDK, which retries for minutes), or no credentials
    configured (MLflow takes the client without them and fails only when the run starts).
    MLflow's warning about the SDK's default auth is kept quiet: this is the one line."""
    import logging

    from mlflow.utils.databricks_utils import get_databricks_host_creds

    host = _databricks_host(uri)
    if host is not None:
        why = _no_answer(host if "://" in host else f"https://{host}")
        if why is not None:
            return f"the Databricks workspace {host} does not answer ({why})"
    quiet = logging.getLogger("mlflow.utils.databricks_utils")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        get_databricks_host_creds(uri)
    except Exception:  # noqa: BLE001 - MLflow's refusal of the configuration, whatever its type
        return (
            "no Databricks credentials are configured: set DATABRICKS_HOST and DATABRICKS_TOKEN, or a profile in "
            "~/.databrickscfg"
        )
    finally:
        quiet.setLevel(level)
    return None


def _databricks_host(uri: str) -> str | None:
    """The workspace host a Databricks ``uri`` names: ``DATABRICKS_HOST``, else its profile's
    ``host`` in the Databricks config file (``databricks://PROFILE``; ``DEFAULT``); ``None``
    when neither says (other auth methods are left to the SDK)."""
    import configparser

    if os.environ.get("DATABRICKS_HOST"):
        return os.environ["DATABRICKS_HOST"]
    profile = uri.split("://", 1)[1].split(":", 1)[0] if "://" in uri else ""
    profile = profile or os.environ.get("DATABRICKS_CONFIG_PROFILE") or "DEFAULT"
    parser = configparser.ConfigParser()
    try:
        parser.read(os.environ.get("DATABRICKS_CONFIG_FILE") or Path.home() / ".databrickscfg")
        return parser.get(profile, "host", fallback=None) or None
    except (OSError, configparser.Error):
        return None


def _wandb_online(mode: str | None) -> bool:
    if str(os.environ.get("WANDB_DISABLED", "")).lower() in ("1", "true", "yes"):
        return False
    return (mode or os.environ.get("WANDB_MODE") or "online").lower() in ("online", "run")


def _wandb_host() -> str:
    """The W&B server a run online talks to (``WANDB_BASE_URL``, else W&B's cloud)."""
    return os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"


def _wandb_credentials() -> bool:
    """An API key in the environment, in ``~/.netrc`` for the W&B host, or in W&B's settings."""
    import configparser
    import netrc
    from urllib.parse import urlparse

    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(_wandb_host()).hostname or "api.wandb.ai"
    try:
        entry = netrc.netrc(os.environ.get("NETRC")).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        entry = None
    if entry is not None and entry[2]:
        return True
    settings = Path(os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb") / "settings"
    parser = configparser.ConfigParser()
    try:
        parser.read(settings)
    except (OSError, configparser.Error):
        return False
    return bool(parser.get("default", "api_key", fallback=""))


def _no_answer(uri: str) -> str | None:
    """Why the HTTP server at ``uri`` did not answer (``None``: it answered, whatever it said)."""
    import socket
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=MLFLOW_PROBE_TIMEOUT_S):
            return None
    except urllib.error.HTTPError:
        return None  # it answered
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, TimeoutError | socket.timeout):
            return f"no answer within {MLFLOW_PROBE_TIMEOUT_S:g} s"
        return str(getattr(reason, "strerror", None) or reason)
    except TimeoutError:
        return f"no answer within {MLFLOW_PROBE_TIMEOUT_S:g} s"
    except (OSError, ValueError) as exc:
        return str(exc)


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
        # a server that stops answering fails the run in seconds, not after minutes of retries
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        if tracking_uri is None or _file_store(tracking_uri) is not None:
            # a local file store needs no server or database (mlflow-skinny has no SQL);
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
