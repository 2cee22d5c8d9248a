"""Issue 35, item 2: ``--overwrite`` deletes nothing when a tracker cannot start. W&B online
without an API key and an MLflow server that refuses connections or does not answer are found
among the checks that run before the previous run is deleted, each in one line, the silent
server within :data:`~geartrain.trainer.loggers.MLFLOW_PROBE_TIMEOUT_S` (it was about 4
minutes of retries, then a traceback, with the old run gone).

The checks read only the environment and the server, never the tracker's library: the
modules put on ``sys.path`` here only make ``wandb`` / ``mlflow`` importable (the core's
environment has neither) and fail the way the real ones do if the job ever starts them."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from geartrain import ConfigError
from geartrain.testing.runs import file_tree, write_finished_run
from geartrain.trainer import load_train_config, run_job
from geartrain.trainer.loggers import MLFLOW_PROBE_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
MAIN_CONFIG = ROOT / "examples" / "arithmetic" / "grpo.toml"
SMALL = ["trainer.total_steps=4", "sft.enabled=false", "trainer.progress=false"]


@pytest.fixture(autouse=True)
def trackers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    site.mkdir()
    for name, error in (("wandb", "api_key not configured (no-tty)"), ("mlflow", "Max retries exceeded")):
        (site / f"{name}.py").write_text(f"def __getattr__(name):\n    raise RuntimeError({error!r})\n")
    monkeypatch.syspath_prepend(str(site))
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))  # no ~/.netrc, no W&B settings
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_DISABLED", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "wandb"))


def _finished_run(out: Path) -> dict[str, str]:
    return write_finished_run(
        load_train_config(MAIN_CONFIG, [*SMALL, f"trainer.output_dir={out}"], check_plugins=False), 4
    )


def _overwrite(out: Path, *overrides: str) -> str:
    config = load_train_config(MAIN_CONFIG, [*SMALL, f"trainer.output_dir={out}", *overrides], check_plugins=False)
    with pytest.raises(ConfigError) as info:
        run_job(config, overwrite=True)
    return str(info.value)


def test_wandb_online_without_a_key_deletes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    before = _finished_run(out)
    text = _overwrite(out, 'trainer.loggers=["wandb"]')
    assert "trainer.loggers: 'wandb' runs online (trainer.wandb_mode / WANDB_MODE) but no W&B API key" in text
    assert file_tree(out) == before


def test_wandb_offline_or_with_a_key_in_netrc_is_not_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answering_server: int
) -> None:
    from geartrain.trainer.loggers import tracker_problems

    assert tracker_problems(["wandb"], "offline", None) == []
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{answering_server}")  # a W&B server that answers
    netrc = tmp_path / "home" / ".netrc"
    netrc.write_text("machine 127.0.0.1\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    assert tracker_problems(["wandb"], None, None) == []


def test_wandb_online_with_a_key_and_a_server_that_refuses_deletes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusing_port: int
) -> None:
    """Rerun of item 2 with a key: W&B retried for about 100 s, then failed, after
    ``--overwrite`` had deleted the previous run's checkpoints."""
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{refusing_port}")
    out = tmp_path / "run"
    before = _finished_run(out)
    text = _overwrite(out, 'trainer.loggers=["wandb"]')
    assert (
        f"trainer.loggers: 'wandb' runs online but the W&B server http://127.0.0.1:{refusing_port} does not answer "
        "(Connection refused)" in text
    ), text
    assert file_tree(out) == before


@pytest.fixture
def answering_server() -> Iterator[int]:
    """An HTTP server that answers every request with 404."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the handler's protocol
            self.send_error(404)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    thread.join()


@pytest.fixture
def refusing_port() -> int:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def silent_server() -> Iterator[int]:
    with socket.socket() as s:  # listens (the kernel completes connections) but never reads or answers
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


def test_an_mlflow_server_that_refuses_deletes_nothing(tmp_path: Path, refusing_port: int) -> None:
    out = tmp_path / "run"
    before = _finished_run(out)
    uri = f"http://127.0.0.1:{refusing_port}"
    text = _overwrite(out, 'trainer.loggers=["mlflow"]', f"trainer.mlflow_tracking_uri={uri}")
    assert (
        f"the MLflow tracking server trainer.mlflow_tracking_uri='{uri}' does not answer (Connection refused)" in text
    )
    assert file_tree(out) == before


def test_an_mlflow_server_that_never_answers_fails_within_the_probe_timeout(tmp_path: Path, silent_server: int) -> None:
    out = tmp_path / "run"
    before = _finished_run(out)
    uri = f"http://127.0.0.1:{silent_server}"
    text = _overwrite(out, 'trainer.loggers=["mlflow"]', f"trainer.mlflow_tracking_uri={uri}")
    # the probe's own deadline ended the wait (no retries)
    assert f"does not answer (no answer within {MLFLOW_PROBE_TIMEOUT_S:g} s)" in text, text
    assert file_tree(out) == before
