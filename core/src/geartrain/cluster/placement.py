"""Choosing a job's placement: the one place that knows every placement (the Ray one is
imported only when asked for, so the inline path needs no Ray)."""

from __future__ import annotations

from typing import Any

from geartrain.cluster.worker_group import InlinePlacement, Placement
from geartrain.errors import ConfigError


def make_placement(cluster: Any, *, log_dir: str | None = None) -> Placement:
    """The placement ``cluster`` (a :class:`~geartrain.trainer.config.ClusterConfig`) asks
    for. ``log_dir``: where Ray ranks write their logs (default: a temporary directory,
    removed at ``close`` unless an error quoted a log in it)."""
    if cluster.placement == "inline":
        return InlinePlacement(cluster)
    if cluster.placement == "ray":
        from geartrain.cluster.ray_placement import RayPlacement, require_ray

        require_ray()
        return RayPlacement(cluster, log_dir=log_dir)
    raise ConfigError([("cluster.placement", f"unknown placement '{cluster.placement}' (use 'inline' or 'ray')")])
