"""The conformance kits run under pytest 10's rules: a plugin author's test file that
subclasses them must not fail (or warn) when ``PytestRemovedIn10Warning`` becomes an error.
Run in a fresh pytest process with that warning turned into an error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

AUTHOR_TESTS = """
from geartrain.testing.engine_suite import EngineConformance
from geartrain.testing.fakes import FakeBackends
from geartrain.testing.rollout_suite import RolloutConformance

FakeBackends().register()  # an engine for the engine kit's fixtures; its tests are not the point


class TestTorchRollout(RolloutConformance):
    backend = "torch"
    families = ("qwen2",)


class TestEngineKitFixtures(EngineConformance):
    backend = "fake"
    families = ("qwen2",)
"""


def test_the_kits_fixtures_run_with_pytest_10_deprecations_as_errors(tmp_path: Path) -> None:
    (tmp_path / "test_author.py").write_text(AUTHOR_TESTS)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-W",
        "error::pytest.PytestRemovedIn10Warning",
        "-rA",
        str(tmp_path / "test_author.py"),
        "-k",
        "test_batch_layout or test_one_rank_consumes_the_whole_batch",
    ]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert "PytestRemovedIn10Warning" not in text, text[-3000:]
    # the rollout kit's class-scoped fixtures built the rollout and the test ran on it; the
    # engine kit's ran too (its test's verdict on the fake engine is not the point)
    assert "PASSED test_author.py::TestTorchRollout::test_batch_layout[qwen2]" in text, text[-3000:]
    assert "test_author.py::TestEngineKitFixtures::test_one_rank_consumes_the_whole_batch[qwen2]" in text, text[-3000:]
    assert "ERROR test_author.py::TestEngineKitFixtures" not in text, text[-3000:]
