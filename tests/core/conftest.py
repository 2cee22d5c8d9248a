"""Fixtures for the core's tests: fake installed distributions for plugin discovery, and the
fake engine and rollout registered (``fakes``, for jobs that test the core's plumbing)."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from geartrain import plugins
from geartrain.testing.fakes import FakeBackends


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Path]]:
    """Install a distribution the way pip lays it out (``<dist>.dist-info`` with
    ``METADATA`` and ``entry_points.txt`` next to its module) on a directory put on
    ``sys.path``, so ``importlib.metadata`` discovers it for real."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    plugins.clear_cache()

    def install(dist: str, version: str, modules: dict[str, str], entry_points: dict[str, dict[str, str]]) -> Path:
        for module, source in modules.items():
            (site / f"{module}.py").write_text(textwrap.dedent(source))
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = []
        for group, eps in entry_points.items():
            lines.append(f"[{group}]")
            lines += [f"{name} = {target}" for name, target in eps.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        plugins.clear_cache()
        return site

    yield install
    for name in list(sys.modules):
        if name.startswith("gtfake_"):
            del sys.modules[name]
    plugins.clear_cache()


@pytest.fixture
def fakes() -> Iterator[FakeBackends]:
    """The fake engine and rollout (``backend = "fake"``), registered for the test."""
    with FakeBackends().registered() as backends:
        yield backends
