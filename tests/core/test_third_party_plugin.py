"""A real third-party engine package (tests/third_party_plugin) goes through the whole
life of a plugin: pip install -> listed -> built by name -> conformance suite -> pip
uninstall -> gone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "third_party_plugin"
DIST = "geartrain-simple-engine"


def run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)


def listed_names() -> dict[str, dict]:
    out = run("-m", "geartrain.cli", "plugins", "--json")
    assert out.returncode == 0, out.stderr
    return {row["name"]: row for row in json.loads(out.stdout)}


@pytest.mark.slow
def test_install_list_build_conform_uninstall(tmp_path: Path) -> None:
    if "simple" in listed_names():
        pytest.fail(f"{DIST} is already installed in this environment; the test needs it absent")
    install = run("-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", str(PACKAGE))
    assert install.returncode == 0, install.stdout + install.stderr
    try:
        row = listed_names()["simple"]
        assert row["kind"] == "engine"
        assert (row["distribution"], row["version"]) == (DIST, "0.3.1")
        assert row["error"] is None
        assert {"forward_backward", "shard", "export_hf"} <= set(row["hooks"])

        built = run(
            "-c",
            "import geartrain\n"
            "from geartrain.config import EngineConfig, ModelConfig\n"
            "e = geartrain.Engine(EngineConfig(backend='simple'), ModelConfig(tiny='qwen2'), "
            "geartrain.EngineContext(role='actor'))\n"
            "print(type(e.handle).__module__, e.info.distribution)",
        )
        assert built.returncode == 0, built.stderr
        assert built.stdout.split() == ["geartrain_simple.plugin", DIST]

        suite = run("-m", "pytest", "-q", "-p", "no:cacheprovider", str(PACKAGE / "tests"), "--rootdir", str(tmp_path))
        assert suite.returncode == 0, suite.stdout[-4000:]
        assert " passed" in suite.stdout and " failed" not in suite.stdout
    finally:
        uninstall = run("-m", "pip", "uninstall", "--yes", "--quiet", DIST)
    assert uninstall.returncode == 0, uninstall.stderr
    assert "simple" not in listed_names()


def test_sglang_plugin_lists_in_a_core_only_environment() -> None:
    """The SGLang rollout plugin installs next to the core alone (no SGLang): ``geartrain
    plugins`` lists it with its version and hooks, the other plugins are unaffected, and
    building it names what is missing."""
    path = PACKAGE.parents[1] / "plugins" / "sglang_rollout"
    install = run("-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", str(path))
    assert install.returncode == 0, install.stdout + install.stderr
    try:
        rows = listed_names()
        row = rows["sglang"]
        assert (row["kind"], row["distribution"], row["version"]) == ("rollout", "geartrain-sglang", "0.1.0")
        assert row["error"] is None and {"generate", "update_weights", "release"} <= set(row["hooks"])
        assert rows["torch"]["error"] is None
        built = run(
            "-c",
            "import geartrain\n"
            "from geartrain.config import ModelConfig, RolloutConfig\n"
            "from geartrain.rollout import Rollout\n"
            "Rollout(RolloutConfig(backend='sglang'), ModelConfig(tiny='qwen2'), "
            "geartrain.EngineContext(role='rollout'))",
        )
        assert built.returncode != 0 and "SGLang is not installed" in built.stderr, built.stderr[-2000:]
    finally:
        run("-m", "pip", "uninstall", "--yes", "--quiet", "geartrain-sglang")
    assert "sglang" not in listed_names()
