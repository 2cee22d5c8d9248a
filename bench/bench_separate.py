"""Separate rollout with bounded staleness vs the colocated synchronous loop, on simulated
long-tail generation, side by side in one run.

Both run the main job's GRPO step (no SFT, from the tiny model) on Ray with the torch
rollout's simulated latency (``rollout.options.simulated_token_s``: every sample "decodes" a
Pareto-distributed number of tokens and finishes at its own time in a continuous-batching
engine, whose weight updates wait for the samples in flight), so the long tail shows on a
2-core machine without burning its cores:

* colocated, synchronous: 1 Ray rank holding trainer and rollout (a step waits for its
  longest sample);
* separate, ``algorithm.max_staleness = 1``: 1 trainer rank + 2 rollout replicas (0.5 CPU
  each), streaming: each step trains the first finished GRPO groups, per-replica weight
  updates from the trainer's send queue.

Steps per second = steps / their summed ``timing/step_s`` (steps 3..N: start-up and the
pipeline's fill left out).

    .venv/bin/python bench/bench_separate.py [--steps 20] [--token-s 0.005] [--alpha 1.2 0.8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from geartrain.trainer.config import load_train_config
from geartrain.trainer.run import Job

ROOT = Path(__file__).resolve().parents[1]
COMMON = [
    "sft.enabled=false",
    "validation.path=null",
    "trainer.tensorboard=false",
    "trainer.plot=false",
    "trainer.export_hf=false",
    "trainer.progress=false",
    "trainer.save_every=0",
    "cluster.placement=ray",
]
SEPARATE = [
    "rollout.placement=separate",
    "rollout.replicas=2",
    "rollout.resources_per_replica={cpus=0.5}",
    "algorithm.max_staleness=1",
]


def steps_per_s(extra: list[str], steps: int, token_s: float, alpha: float) -> dict[str, float]:
    out = Path(tempfile.mkdtemp(prefix="bench-separate-")) / "run"
    config = load_train_config(
        ROOT / "examples/arithmetic/grpo.toml",
        [
            *COMMON,
            f"trainer.total_steps={steps}",
            f"trainer.output_dir={out}",
            f"rollout.options.simulated_token_s={token_s}",
            f"rollout.options.simulated_tail_alpha={alpha}",
            *extra,
        ],
    )
    start = time.perf_counter()
    Job(config, echo=lambda _: None).run()
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if r.get("step", 0) >= 3 and "timing/step_s" in r]
    walls = [r["timing/step_s"] for r in steady]
    result = {
        "steps_per_s": len(walls) / sum(walls),
        "step_s_median": statistics.median(walls),
        "generate_s_median": statistics.median(r["timing/generate_s"] for r in steady),
        "update_s_median": statistics.median(r["timing/update_s"] for r in steady),
        "job_wall_s": wall,
    }
    if "async/staleness_max" in steady[-1]:
        result["staleness_max"] = max(r["async/staleness_max"] for r in steady)
        result["staleness_mean"] = statistics.mean(r["async/staleness_mean"] for r in steady)
    if "async/dropped_groups" in steady[-1]:
        result["dropped_groups_per_step"] = statistics.mean(r["async/dropped_groups"] for r in steady)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--token-s", type=float, default=0.005)
    parser.add_argument("--alpha", type=float, nargs="+", default=[1.2, 0.8])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    for alpha in args.alpha:
        colocated = steps_per_s([], args.steps, args.token_s, alpha)
        print(f"alpha {alpha}: colocated, synchronous:", {k: round(v, 4) for k, v in colocated.items()}, flush=True)
        separate = steps_per_s(SEPARATE, args.steps, args.token_s, alpha)
        print(
            f"alpha {alpha}: separate, 2 replicas, max_staleness=1:",
            {k: round(v, 4) for k, v in separate.items()},
            flush=True,
        )
        print(
            f"alpha {alpha}: speed-up {separate['steps_per_s'] / colocated['steps_per_s']:.2f}x; "
            f"load average now: {os.getloadavg()}",
            flush=True,
        )


if __name__ == "__main__":
    main()
