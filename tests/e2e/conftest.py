"""Fixtures of the end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
