"""The Ray placement's costs, side by side in one run.

1. Dispatch overhead: one ``WorkerGroup.call`` from the driver to N Ray ranks and back, for a
   trivial method (``Dispatch.ALL``) and for a main-job-sized rollout batch split and
   gathered (``Dispatch.DP``: 128 rows x 21 tokens, the per-token tensors of one step).
2. The main job's GRPO step (no SFT, from the tiny model; the same config otherwise) inline
   vs 2 Ray ranks (FSDP dp=2, colocated torch rollouts), on Ray without and with
   ``trainer.prefetch_generation`` (the next step's generation sent behind the update):
   wall time per step, CPU time per step summed over the driver and every rank, and on Ray
   the dispatch overhead of the step's calls (each call's wall on the driver not spent in
   the slowest rank's method nor, for a submitted call, in the driver's own work,
   :class:`geartrain.cluster.ray_placement.DispatchStats`) as seconds and as a share of the
   steps' wall time.

    .venv/bin/python bench/bench_ray.py [--steps 30] [--calls 200]

Both clocks are printed: on a shared machine the wall clock swings with the load.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from geartrain.batch import Batch
from geartrain.cluster import Dispatch, make_placement
from geartrain.cluster.ray_placement import RayPlacement
from geartrain.trainer.config import ClusterConfig, RankResources, load_train_config
from geartrain.trainer.run import Job

ROOT = Path(__file__).resolve().parents[1]


class Echo:
    """A worker that does nothing: what remains is the dispatch."""

    def __init__(self, *, ctx) -> None:  # noqa: ANN001
        self.ctx = ctx

    def noop(self) -> int:
        return self.ctx.rank

    def touch(self, batch: Batch) -> Batch:
        return batch.select("log_probs")


def main_job_batch(rows: int = 128, width: int = 21) -> Batch:
    ids = torch.randint(0, 100, (rows, width))
    ones = torch.ones(rows, width, dtype=torch.long)
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": ones,
            "response_mask": ones,
            "log_probs": torch.randn(rows, width),
            "advantages": torch.randn(rows, width),
        },
        meta={"uid": list(range(rows))},
    )


def dispatch_overhead(ranks: int, calls: int) -> dict[str, float]:
    cluster = ClusterConfig(placement="ray", resources_per_rank=RankResources(cpus=min(1.0, 2 / ranks)))
    placement = make_placement(cluster)
    try:
        group = placement.group(f"echo{ranks}", Echo, world_size=ranks)
        batch = main_job_batch()
        out: dict[str, float] = {}
        for name, call in (
            ("all_noop", lambda: group.call("noop")),
            ("dp_batch", lambda: group.call("touch", batch, dispatch=Dispatch.DP)),
        ):
            for _ in range(10):
                call()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(calls):
                call()
            out[f"{name}_ms"] = 1000 * (time.perf_counter() - wall) / calls
            out[f"{name}_driver_cpu_ms"] = 1000 * (time.process_time() - cpu) / calls
        group.shutdown()
        return out
    finally:
        placement.close()


def step_times(ray: bool, steps: int, extra: tuple[str, ...] = ()) -> dict[str, float]:
    overrides = [
        *extra,
        "sft.enabled=false",
        "validation.path=null",
        "trainer.tensorboard=false",
        "trainer.plot=false",
        "trainer.export_hf=false",
        "trainer.progress=false",
        "trainer.save_every=0",
        f"trainer.total_steps={steps}",
    ]
    if ray:
        overrides += ["cluster.placement=ray", "actor.engine.parallel.dp=2"]
    out_dir = Path(tempfile.mkdtemp(prefix="bench-ray-")) / "run"
    config = load_train_config(ROOT / "examples/arithmetic/grpo.toml", [*overrides, f"trainer.output_dir={out_dir}"])
    rank_cpu: list[float] = []
    original_close = RayPlacement.close

    def close(self: RayPlacement, graceful: bool = True) -> None:  # read the ranks' CPU clocks before they stop
        import ray as _ray

        for pool in self.pools.values():
            rank_cpu.extend(_ray.get([h.cpu_seconds.remote() for h in pool.hosts]))
        original_close(self, graceful)

    RayPlacement.close = close  # type: ignore[method-assign]
    cpu = time.process_time()
    job = Job(config, echo=lambda _: None)
    try:
        job.run()
    finally:
        RayPlacement.close = original_close  # type: ignore[method-assign]
    driver_cpu = time.process_time() - cpu
    import json

    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    walls = [r["timing/step_s"] for r in records if r.get("step", 0) >= 3 and "timing/step_s" in r]
    out = {"step_wall_s": statistics.median(walls), "cpu_s_per_step": (driver_cpu + sum(rank_cpu)) / steps}
    groups = getattr(job.placement, "groups", [])
    if groups:  # every call of the run (checkpoints included): wall minus the slowest rank's work
        overhead = sum(g.stats.overhead_s for g in groups)
        out["dispatch_s_per_step"] = overhead / steps
        out["dispatch_share_of_step"] = overhead / sum(r["timing/step_s"] for r in records if "timing/step_s" in r)
        out["calls_per_step"] = sum(g.stats.calls for g in groups) / steps
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for ranks in (1, 2):
        print(
            f"dispatch, {ranks} rank(s):",
            {k: round(v, 3) for k, v in dispatch_overhead(ranks, args.calls).items()},
            flush=True,
        )
    inline = step_times(False, args.steps)
    print("main-job step inline:", {k: round(v, 4) for k, v in inline.items()}, flush=True)
    for prefetch in ("false", "true"):
        two = step_times(True, args.steps, (f"trainer.prefetch_generation={prefetch}",))
        print(
            f"main-job step 2 Ray ranks, prefetch_generation={prefetch}:",
            {k: round(v, 4) for k, v in two.items()},
            flush=True,
        )


if __name__ == "__main__":
    main()
