"""Weights & Biases and MLflow as optional loggers (issue 19, item 6), each with the real
library: W&B offline, MLflow in a local store; both get the numbers metrics.jsonl has."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from e2e_helpers import MAIN_CONFIG
from geartrain.errors import ConfigError
from geartrain.testing.runs import file_tree, write_finished_run
from geartrain.trainer import load_train_config, run_job

RUN = [
    "sft.enabled=false",
    "trainer.progress=false",
    "trainer.plot=false",
    "trainer.export_hf=false",
    "trainer.total_steps=3",
    "validation.every_n_steps=0",
    "validation.max_prompts=8",
]


def wandb_history(path: Path) -> list[dict[str, str]]:
    """The history rows of an offline W&B run file (a LevelDB-style log of protobuf records:
    32 KiB blocks, 7-byte record headers after a 7-byte file header), as W&B would upload them."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, pending, rows = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): i.value_json for i in record.history.item})
    return rows


def test_wandb_offline_and_mlflow_local_get_every_metric(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    config = load_train_config(
        MAIN_CONFIG,
        [
            *RUN,
            'trainer.loggers=["tensorboard", "wandb", "mlflow"]',
            "trainer.wandb_mode=offline",
            "trainer.run_name=probe",
            f"trainer.output_dir={out}",
        ],
        check_plugins=False,
    )
    run_job(config)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    entropy = {r["step"]: r["actor/entropy"] for r in records if "actor/entropy" in r}
    assert sorted(entropy) == [1, 2, 3] and all(v > 0 for v in entropy.values())

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("geartrain")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "probe" and run.data.params["trainer.total_steps"] == "3"
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "actor/entropy")}
    assert history == pytest.approx(entropy)

    (offline,) = (out / "wandb").glob("offline-run-*")
    (run_file,) = offline.glob("run-*.wandb")
    logged = {
        int(h["trainer/step"]): float(h["actor/entropy"]) for h in wandb_history(run_file) if "actor/entropy" in h
    }
    assert logged == pytest.approx(entropy)
    assert (out / "tensorboard").is_dir()


def test_a_logger_that_is_not_installed_names_its_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from geartrain.trainer.preflight import preflight

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    config = load_train_config(
        MAIN_CONFIG, [*RUN, 'trainer.loggers=["wandb"]', f"trainer.output_dir={tmp_path}"], check_plugins=False
    )
    with pytest.raises(
        ConfigError, match=r"trainer.loggers: 'wandb' is not installed; install it: pip install './core\[wandb\]'"
    ):
        preflight(config)


def _finished_run(out: Path) -> dict[str, str]:
    return write_finished_run(
        load_train_config(MAIN_CONFIG, [*RUN, f"trainer.output_dir={out}"], check_plugins=False), 3
    )


@pytest.mark.parametrize("store", ["sqlite", "ftp", "file-under-a-file"])
def test_an_mlflow_store_it_cannot_open_deletes_nothing(tmp_path: Path, store: str) -> None:
    """Issue 35, item 2, rerun on other stores: a tracking URI that is not an HTTP server
    (a database, another scheme, a file store that cannot be written) is checked with the
    other trackers before ``--overwrite`` deletes anything (it was deleted, then MLflow
    failed to start)."""
    (tmp_path / "a_file").write_text("")
    uri = {
        "sqlite": f"sqlite:///{tmp_path}/mlflow.db",
        "ftp": "ftp://127.0.0.1/mlruns",
        "file-under-a-file": (tmp_path / "a_file" / "mlruns").as_uri(),
    }[store]
    out = tmp_path / "run"
    before = _finished_run(out)
    config = load_train_config(
        MAIN_CONFIG,
        [*RUN, 'trainer.loggers=["mlflow"]', f"trainer.mlflow_tracking_uri={uri}", f"trainer.output_dir={out}"],
        check_plugins=False,
    )
    with pytest.raises(ConfigError) as info:
        run_job(config, overwrite=True)
    assert f"trainer.loggers: MLflow cannot use trainer.mlflow_tracking_uri='{uri}'" in str(info.value), info.value
    assert len(str(info.value).splitlines()) == 2  # the head line and this problem's
    assert file_tree(out) == before


def test_an_mlflow_file_store_named_by_its_uri_gets_every_metric(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``file://`` tracking URI is a local store like the default one (MLflow 3 refused it
    unless MLFLOW_ALLOW_FILE_STORE was set: after ``--overwrite`` had deleted the run)."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    store = (tmp_path / "store").as_uri()
    out = tmp_path / "run"
    config = load_train_config(
        MAIN_CONFIG,
        [*RUN, 'trainer.loggers=["mlflow"]', f"trainer.mlflow_tracking_uri={store}", f"trainer.output_dir={out}"],
        check_plugins=False,
    )
    run_job(config)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    entropy = {r["step"]: r["actor/entropy"] for r in records if "actor/entropy" in r}
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("geartrain").experiment_id])
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "actor/entropy")}
    assert sorted(entropy) == [1, 2, 3] and history == pytest.approx(entropy)


@pytest.mark.parametrize("credentials", ["none", "a host that refuses"])
def test_a_databricks_uri_it_cannot_use_deletes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], credentials: str
) -> None:
    """Probe 2c left by probes3 (issue 35, item 2): ``mlflow_tracking_uri=databricks`` without
    credentials passed the checks (MLflow makes its client without them) and failed when
    the run started, after ``--overwrite`` had set the previous run aside, with an MLflow
    warning line before the error. Now one line, before anything is moved."""
    for var in ("DATABRICKS_HOST", "DATABRICKS_TOKEN", "DATABRICKS_CONFIG_PROFILE", "DATABRICKS_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.databrickscfg
    said = "no Databricks credentials are configured: set DATABRICKS_HOST and DATABRICKS_TOKEN"
    if credentials != "none":
        with socket.socket() as s:  # a port nothing listens on: connections are refused
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        monkeypatch.setenv("DATABRICKS_HOST", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("DATABRICKS_TOKEN", "dapi-not-a-token")
        said = f"the Databricks workspace http://127.0.0.1:{port} does not answer"
    out = tmp_path / "run"
    before = _finished_run(out)
    config = load_train_config(
        MAIN_CONFIG,
        [*RUN, 'trainer.loggers=["mlflow"]', "trainer.mlflow_tracking_uri=databricks", f"trainer.output_dir={out}"],
        check_plugins=False,
    )
    capfd.readouterr()
    with pytest.raises(ConfigError) as info:
        run_job(config, overwrite=True)
    assert "trainer.loggers: MLflow cannot use trainer.mlflow_tracking_uri='databricks' (" + said in str(info.value), (
        info.value
    )
    assert len(str(info.value).splitlines()) == 2
    assert file_tree(out) == before
    printed = capfd.readouterr()
    assert "WARNING" not in printed.err + printed.out, printed
