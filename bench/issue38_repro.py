"""Issue 38 reproducer: the Ray dp=2 main job's actor, training and syncing weights, bounded.

Two Ray ranks (geartrain's own Ray placement, a local Ray instance of its own) each build the
main job's actor (:class:`geartrain.trainer.roles.ActorRolloutWorker`: the FSDP engine on the
tiny Qwen2 of examples/arithmetic/grpo.toml, and the torch rollout), then:

* ``--mode loop`` (default): inside one Ray call per ``--steps`` iterations, each iteration one
  optimizer step on a fixed rollout batch (``update_once``, as GRPO's one-update steps) and the
  hybrid engine's weight sync (``_enter_rollout``: ``reshard_for_rollout`` ->
  ``DTensor.full_tensor`` of every parameter -> the rollout's ``update_weights``), no
  generation; ``--no-train``: the weight syncs alone;
* ``--mode real``: per step a Ray ``generate`` call (weight sync, then generation, the batch
  back through Ray) and a Ray ``update_once`` call with that batch: the GRPO loop's Ray traffic
  without rewards.

A native abort in a rank (issue 38: "double free or corruption (fasttop)", "malloc():
unaligned tcache chunk detected") fails the call; the script then reports the steps done.

    python bench/issue38_repro.py --minutes 20 [--mode real] [--steps 100] [--out DIR]

Bounded by ``--minutes`` (a benchmark, not a test). Prints JSON lines (steps so far, load) and a
summary line (steps, seconds, crashed or not, load). Run it beside a CPU hog; with glibc's
allocator replaced by ASan's (``LD_PRELOAD=libasan.so.8`` with a quarantine, see
/work/notes/i38.md) a stale free would be reported with both stacks instead of corrupting the heap.

Measured 2026-11-28 (2-core x86_64 VM, 24 GiB, no GPU, torch 2.13.0, fresh environment with
numpy 2.4.6, beside 2 busy loops and a test suite, load 6-10): ``loop`` 7,700 steps in 16 min,
no crash; ``real`` under ASan 2,204 steps in 20 min (quarantine 64 MiB) and 2,733 in 38 min
(256 MiB), no report, no crash.
The real job aborts about once in 10 jobs of ~1,500 steps, so neither rate separates yet.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _worker_class() -> type:
    from geartrain.trainer.roles import ActorRolloutWorker

    class StressWorker(ActorRolloutWorker):
        """The main job's actor with a loop of train step + weight sync."""

        batch = None

        def stress(self, steps: int, train: bool = True) -> dict:
            import torch
            from geartrain.types import SamplingParams

            if self.batch is None:
                tok = self._tokenizer()
                prompts = [tok.encode(f"{a}+{b}=") for a, b in ((12, 34), (45, 27), (80, 9), (3, 66))]
                batch, _ = self.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=5))
                gen = torch.Generator().manual_seed(self.rank)
                mask = batch["response_mask"].float()
                batch["loss_mask"] = batch["response_mask"]
                batch["advantages"] = torch.randn(mask.shape, generator=gen) * mask
                self.batch = batch
            start = time.perf_counter()
            for _ in range(steps):
                if train:
                    self.update_once(self.batch)
                else:
                    self.weights_stale = True
                self._enter_rollout({})
            return {"steps": steps, "seconds": time.perf_counter() - start}

    return StressWorker


def _real_steps(group: object, deadline: float, ready: float) -> tuple[int, str | None]:
    """The GRPO loop's Ray traffic without rewards: ``generate`` (weight sync + generation,
    the batch back through Ray), then ``update_once`` with that batch (through Ray)."""
    import torch
    from geartrain.cluster import Dispatch
    from geartrain.cluster.dispatch import prompt_batch
    from geartrain.types import SamplingParams

    prompts = [[3 + (i * 7 + j) % 10 for j in range(6)] for i in range(8)]
    sampling = SamplingParams(n=4, temperature=1.0, max_tokens=5)
    gen = torch.Generator().manual_seed(0)
    steps = 0
    while time.time() < deadline:
        try:
            batch, _ = group.call("generate", prompt_batch(prompts), sampling, dispatch=Dispatch.DP)  # type: ignore[attr-defined]
            batch["loss_mask"] = batch["response_mask"]
            batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=gen) * batch["response_mask"]
            group.call("update_once", batch, dispatch=Dispatch.DP)  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - a rank's abort is the measurement
            print(f"call failed: {exc}", file=sys.stderr, flush=True)
            return steps, f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
        steps += 1
        if steps % 200 == 0:
            print(
                json.dumps({"syncs": steps, "elapsed_s": round(time.time() - ready, 1), "load": os.getloadavg()[0]}),
                flush=True,
            )
    return steps, None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--steps", type=int, default=200, help="iterations per Ray call")
    p.add_argument("--no-train", action="store_true", help="weight syncs only")
    p.add_argument(
        "--mode",
        choices=["loop", "real"],
        default="loop",
        help="loop: --steps iterations inside one Ray call; real: per step a Ray generate call (weight sync, "
        "then generation) and a Ray update_once call with the batch, as the GRPO loop does",
    )
    p.add_argument("--out", default="/tmp/i38/repro")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()

    from geartrain.cluster import Dispatch
    from geartrain.cluster.placement import make_placement
    from geartrain.trainer.config import load_train_config
    from geartrain.trainer.loss_config import actor_loss_config

    overrides = [
        "cluster.placement=ray",
        "actor.engine.parallel.dp=2",
        f"trainer.output_dir={a.out}",
        *a.overrides,
    ]
    cfg = load_train_config(ROOT / "examples" / "arithmetic" / "grpo.toml", overrides)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    placement = make_placement(cfg.cluster, log_dir=str(out / "logs"))

    t0 = time.time()
    total = 0
    crashed = None
    try:
        group = placement.group(
            "actor",
            _worker_class(),
            cfg.actor.engine,
            cfg.model,
            cfg.rollout,
            actor_loss_config(cfg),
            free_memory=cfg.trainer.free_memory,
            world_size=2,
            pool="actor",
            seed=0,
        )
        ready = time.time()
        print(json.dumps({"event": "ready", "startup_s": round(ready - t0, 1)}), flush=True)
        deadline = ready + a.minutes * 60
        if a.mode == "real":
            total, crashed = _real_steps(group, deadline, ready)
        while a.mode == "loop" and time.time() < deadline:
            try:
                res = group.call("stress", a.steps, not a.no_train, dispatch=Dispatch.ALL)
            except Exception as exc:  # noqa: BLE001 - a rank's abort is the measurement
                print(f"call failed: {exc}", file=sys.stderr, flush=True)
                crashed = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
                break
            total += a.steps
            print(
                json.dumps(
                    {
                        "syncs": total,
                        "elapsed_s": round(time.time() - ready, 1),
                        "round_s": [round(r["seconds"], 2) for r in (res if isinstance(res, list) else [res])],
                        "load": os.getloadavg()[0],
                    }
                ),
                flush=True,
            )
    finally:
        elapsed = time.time() - (ready if "ready" in locals() else t0)
        summary = {
            "event": "done",
            "syncs_completed": total,
            "seconds": round(elapsed, 1),
            "crashed": crashed,
            "train": not a.no_train,
            "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "env": {
                k: os.environ[k] for k in ("OPENBLAS_NUM_THREADS", "MALLOC_ARENA_MAX", "LD_PRELOAD") if k in os.environ
            },
        }
        print(json.dumps(summary), flush=True)
        try:
            placement.close(graceful=crashed is None)
        except Exception as exc:  # noqa: BLE001
            print(f"close: {exc}", file=sys.stderr)
    return 1 if crashed else 0


if __name__ == "__main__":
    raise SystemExit(main())
