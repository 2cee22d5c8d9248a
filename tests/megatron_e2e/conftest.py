"""The Megatron main job on Ray (``make test-megatron-e2e``, not part of ``make test``)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("ray")
pytest.importorskip("geartrain_megatron")

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_TMPDIR", "/tmp/geartrain-ray")
