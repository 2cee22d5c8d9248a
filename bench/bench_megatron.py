"""Megatron engine vs FSDP engine: training tokens/s (``forward_backward`` + ``optimizer_step``)
on the same model, batch and loss, side by side in one run.

The two engines live in different environments (``.venvs/megatron``: core + megatron-core;
``.venvs/fsdp``: core + the FSDP plugin), so this driver starts one long-lived worker
process per engine, each in its own venv's python, and interleaves their steps (one step of
one, then one of the other, ``--repeats`` times) so that load from other processes hits both
alike. Each worker times its own steps on both clocks: wall (``perf_counter``) and its
process CPU time (``process_time``, all threads). One rank each, CPU or GPU as available.

Usage: ``python bench/bench_megatron.py [--repeats 5] [--hidden 256] [--layers 4] [--threads 1]``
(any python: the driver imports nothing from geartrain). Prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENVS = {"megatron": ROOT / ".venvs/megatron/bin/python", "fsdp": ROOT / ".venvs/fsdp/bin/python"}


# ----------------------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> None:
    import torch
    from geartrain.batch import Batch
    from geartrain.config import EngineConfig, ModelConfig, OptimConfig
    from geartrain.engine import Engine
    from geartrain.types import EngineContext, LossContext

    torch.set_num_threads(args.threads)

    def loss_fn(outputs: dict, mb: Batch, ctx: LossContext) -> tuple:
        mask = mb["loss_mask"].to(outputs["log_probs"].dtype)
        share = -(outputs["log_probs"] * mask).sum() / ctx.global_tokens
        return share, {"loss": float(share.detach())}

    def make_batch(variable: bool) -> Batch:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(4, 128, (args.rows, args.width), generator=g)
        mask = torch.ones(args.rows, args.width, dtype=torch.long)
        if variable:  # lengths uniform in [width/8, width], right padded
            lengths = torch.randint(args.width // 8, args.width + 1, (args.rows,), generator=g)
            mask = (torch.arange(args.width)[None] < lengths[:, None]).long()
            ids = ids * mask
        loss_mask = mask.clone()
        loss_mask[:, : args.width // 4] = 0
        return Batch({"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask})

    overrides = dict(
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    config = EngineConfig(
        backend=args.worker, optim=OptimConfig(lr=1e-4), max_tokens_per_micro_batch=args.rows * args.width
    )
    engine = Engine(config, ModelConfig(tiny="qwen2", seed=0, config_overrides=overrides), EngineContext(role="actor"))
    batches = {"equal": make_batch(False), "variable": make_batch(True)}
    print(json.dumps({"ready": True, "torch": torch.__version__, "device": str(engine.handle.device)}), flush=True)
    for line in sys.stdin:
        kind = line.strip()
        if not kind:
            break
        batch = batches[kind]
        wall, cpu = time.perf_counter(), time.process_time()
        out = engine.forward_backward(batch, loss_fn)
        stats = engine.optimizer_step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        tokens = int(batch["attention_mask"].sum())
        print(
            json.dumps(
                {
                    "wall": wall,
                    "cpu": cpu,
                    "tokens": tokens,
                    "grad_norm": stats["grad_norm"],
                    "loss": out.metrics.get("loss"),
                }
            ),
            flush=True,
        )


# ----------------------------------------------------------------------------- driver


def _start(name: str, args: argparse.Namespace) -> subprocess.Popen:
    python = VENVS[name]
    if not python.exists():
        raise SystemExit(f"{python} is missing: run `make {python.parent.parent}/.ok` first")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    cmd = [
        str(python),
        __file__,
        "--worker",
        name,
        "--threads",
        str(args.threads),
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--rows",
        str(args.rows),
        "--width",
        str(args.width),
    ]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    hello = json.loads(proc.stdout.readline())
    assert hello.get("ready"), hello
    print(f"# {name}: {python.parent.parent.name} venv, torch {hello['torch']}, device {hello['device']}")
    return proc


def _step(proc: subprocess.Popen, kind: str) -> dict:
    proc.stdin.write(kind + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def driver(args: argparse.Namespace) -> None:
    load = os.getloadavg()
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  {platform.machine()}  {os.cpu_count()} cores  "
        f"load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}  threads/worker {args.threads}"
    )
    print(
        f"# model: qwen2 hidden={args.hidden} layers={args.layers} vocab=128 fp32; batch {args.rows} x {args.width}; "
        f"forward_backward + optimizer_step (Adam, clipping); "
        f"median of {args.repeats} interleaved steps after 1 warm-up"
    )
    procs = {name: _start(name, args) for name in ("megatron", "fsdp")}
    try:
        rows = []
        for kind in ("equal", "variable"):
            samples: dict[str, list[dict]] = {name: [] for name in procs}
            warm = {name: _step(proc, kind) for name, proc in procs.items()}  # warm-up
            # same model, batch and loss: the first step must agree (the engines do the same work)
            print(
                f"# {kind}: first-step loss megatron {warm['megatron']['loss']:.6f} fsdp {warm['fsdp']['loss']:.6f}, "
                f"grad norm {warm['megatron']['grad_norm']:.6f} / {warm['fsdp']['grad_norm']:.6f}"
            )
            for _ in range(args.repeats):
                for name, proc in procs.items():
                    samples[name].append(_step(proc, kind))
            tokens = samples["megatron"][0]["tokens"]
            rate = {
                (name, clock): tokens / statistics.median(s[clock] for s in samples[name])
                for name in procs
                for clock in ("wall", "cpu")
            }
            rows.append((kind, tokens, rate))
        print(f"load after: {os.getloadavg()[0]:.1f}")
        print(
            "| batch | real tokens | megatron tok/s (wall) | fsdp tok/s (wall) | megatron/fsdp (wall) "
            "| megatron tok/s (CPU) | fsdp tok/s (CPU) | megatron/fsdp (CPU) |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for kind, tokens, r in rows:
            print(
                f"| {kind} | {tokens} | {r['megatron', 'wall']:,.0f} | {r['fsdp', 'wall']:,.0f} | "
                f"{r['megatron', 'wall'] / r['fsdp', 'wall']:.2f} | {r['megatron', 'cpu']:,.0f} | "
                f"{r['fsdp', 'cpu']:,.0f} | {r['megatron', 'cpu'] / r['fsdp', 'cpu']:.2f} |"
            )
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=sorted(VENVS), help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--width", type=int, default=128)
    # 1: on a shared machine a 2-thread worker's OpenMP threads spin while the other waits
    # for a core, which inflates even the CPU clock (measured: ratios 0.9 to 4.6 between runs)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
