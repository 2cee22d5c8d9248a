"""The Ray placement's tests: real local Ray instances (and a simulated two-node cluster),
FSDP ranks over gloo. Every test stops what it started, also when it fails: a Ray instance
holds ~0.7 GiB and each rank ~0.3 GiB."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

pytest.importorskip("ray")
pytest.importorskip("geartrain_fsdp")


@pytest.fixture(scope="module", autouse=True)
def no_ray_left_behind() -> Iterator[None]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_TMPDIR", "/tmp/geartrain-ray")
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()
