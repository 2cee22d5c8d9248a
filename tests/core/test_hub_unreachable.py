"""A hub id as ``model.path`` on a machine that cannot reach the hub is one line at once
(issue 35's probes, rerun: 20-45 lines of huggingface_hub's retries and about a minute before
the error); a hub that answers, a local directory and offline mode are not probed or refused."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from geartrain.errors import ConfigError
from geartrain.hub import hub_unreachable
from geartrain.trainer import load_train_config
from geartrain.trainer.preflight import preflight

JOB = Path(__file__).resolve().parents[2] / "examples" / "arithmetic" / "grpo.toml"
HUB_ID = "someone/no-such-model-here"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the block ends: connections are refused


@pytest.fixture
def answering_hub() -> Iterator[str]:
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:  # noqa: N802 - the handler's protocol
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_hub_id_the_hub_cannot_serve_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))  # nothing cached
    config = load_train_config(
        JOB, [f"model.path={HUB_ID}", "model.tiny=null", "model.config_overrides={}"], check_plugins=False
    )
    with pytest.raises(ConfigError) as info:
        preflight(config)
    problem = str(info.value).split("problem(s)\n", 1)[1].strip()
    assert "\n" not in problem, problem
    assert problem.startswith(f"model.path: '{HUB_ID}' is no file or directory here"), problem
    assert "cannot be reached from here" in problem and f"hf download {HUB_ID} --local-dir DIR" in problem


def test_a_hub_that_answers_a_local_directory_and_offline_mode_are_not_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, answering_hub: str
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", answering_hub)
    assert hub_unreachable(HUB_ID) is None  # it answers (404 for the root is an answer)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    assert hub_unreachable(HUB_ID) is not None
    assert hub_unreachable(str(tmp_path)) is None  # exists here
    assert hub_unreachable("./relative/dir") is None  # a path, not a hub id
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_unreachable(HUB_ID) is None  # transformers reads the cache and says what it lacks
