"""A 2-rank job across a simulated two-node cluster (``ray.cluster_utils.Cluster``: a head
and a worker node, one CPU each), joined through ``cluster.address``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from ray_helpers import MAIN_CONFIG, RAY2, SHORT, records, run_cli

pytestmark = [pytest.mark.slow]


def test_two_rank_job_across_two_nodes(tmp_path: Path) -> None:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        out = tmp_path / "run"
        proc = run_cli(
            "train",
            str(MAIN_CONFIG),
            *SHORT,
            *RAY2,
            "trainer.total_steps=2",
            "trainer.save_every=0",
            f"cluster.address={cluster.address}",
            f"trainer.output_dir={out}",
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert [r["step"] for r in records(out / "metrics.jsonl")] == [0, 1, 2]
        nodes = [
            re.search(r"\(Ray node (\w+)\)", (out / "logs" / f"actor-rank{r}.log").read_text()).group(1) for r in (0, 1)
        ]
        assert nodes[0] != nodes[1], "both ranks ran on one node"
        assert set(nodes) == {n.node_id for n in cluster.list_all_nodes()}
    finally:
        cluster.shutdown()
