"""LoRA vs full fine-tuning: peak memory and time of one GRPO-shaped update step (forward +
backward + AdamW step) on the same model and batch, with the fsdp engine on a one-rank
FSDP2 group (as a one-GPU job runs).

Each configuration runs in a child process of its own, so one's memory never counts in the
other's (on CPU the resident set is what is measured, and the allocator keeps what it
freed). Per configuration: the model is built, one warm-up step runs, then ``--steps``
timed steps; the peak is taken over the timed steps, above the process's state before the
model was built: the weights, gradients, optimizer state and activations together.

    python bench/bench_lora.py --model tiny                  # the main job's model (CPU)
    python bench/bench_lora.py --model qwen2.5-0.5b --rows 4 --prompt-tokens 32 --response-tokens 32
    python bench/bench_lora.py --model qwen2.5-1.5b --device cuda   # bench/gpu/run_lora_on_device.sh

Goal (issue 23): LoRA's peak <= 0.4x full fine-tuning's on qwen2.5-1.5b.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any


def one(args: argparse.Namespace) -> dict[str, Any]:
    """Run one configuration in this process; return its figures."""
    import torch
    from geartrain.bench_memory import PeakMeter, _model_config
    from geartrain.cluster.process_group import acquire_single_rank_group
    from geartrain.config import EngineConfig, LoraConfig, OptimConfig
    from geartrain.engine import Engine
    from geartrain.layout import sequence_batch
    from geartrain.testing.reference import token_mean_nll_loss
    from geartrain.types import EngineContext

    torch.set_num_threads(args.threads)
    device = args.device
    start_meter = PeakMeter(device)  # baseline: before the model exists
    group = acquire_single_rank_group(device)
    dtype = args.param_dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    lora = LoraConfig(rank=args.rank, alpha=2 * args.rank) if args.which == "lora" else None
    model = _model_config(args.model)
    if args.lora_base_dtype and args.which == "lora":  # the frozen base only: full training keeps fp32 masters
        model = model.model_copy(update={"dtype": args.lora_base_dtype})
    engine = Engine(
        EngineConfig(
            backend="fsdp",
            param_dtype=dtype,
            gradient_checkpointing=args.gradient_checkpointing,
            max_tokens_per_micro_batch=args.micro_batch_tokens,
            optim=OptimConfig(lr=1e-5),
            lora=lora,
        ),
        model,
        EngineContext(role="actor", device=device, process_group=group),
    )
    hf = engine.handle.hf
    params = sum(p.numel() for p in hf.parameters())
    trainable = sum(p.numel() for p in hf.parameters() if p.requires_grad)
    g = torch.Generator().manual_seed(0)
    samples = args.samples
    prompts = [torch.randint(4, 100, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.rows // samples)]
    batch = sequence_batch(
        [p for p in prompts for _ in range(samples)],
        [torch.randint(4, 100, (args.response_tokens,), generator=g).tolist() for _ in range(args.rows)],
        0,
        mask_key="loss_mask",
    )

    def step() -> None:
        engine.forward_backward(batch, token_mean_nll_loss)
        engine.optimizer_step()

    step()  # warm-up: optimizer state allocated, kernels chosen
    meter = PeakMeter(device)
    meter.baseline = start_meter.baseline
    times = []
    with meter.phase("update"):
        for _ in range(args.steps):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t = time.perf_counter()
            step()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    return {
        "which": args.which,
        "model": args.model,
        "device": device,
        "parameters": params,
        "trainable": trainable,
        "peak_bytes": meter.peaks["update"],
        "step_s": statistics.median(times),
        "step_s_all": times,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny or a preset (qwen2.5-0.5b, qwen2.5-1.5b, ...)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--samples", type=int, default=4, help="responses per prompt (rows share prompts)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--response-tokens", type=int, default=64)
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "2")))
    p.add_argument("--param-dtype", default=None, help="compute dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--lora-base-dtype", default=None, help="dtype of LoRA's frozen base weights (default: float32)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--which", choices=["full", "lora"], help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.which:  # a child
        print(json.dumps(one(args)))
        return 0
    results = []
    for which in ("full", "lora"):
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--which", which]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{which}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
            return 1
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    full, lora = results
    print(
        f"{args.model} on {args.device}, {args.rows} rows of {args.prompt_tokens}+{args.response_tokens} tokens, "
        f"{args.threads} threads, LoRA rank {args.rank} all-linear"
    )
    for r in results:
        print(
            f"  {r['which']:<5} trainable {r['trainable'] / 1e6:9.2f}M of {r['parameters'] / 1e6:9.2f}M  "
            f"peak {r['peak_bytes'] / 2**30:7.3f} GiB  step {r['step_s']:.3f} s"
        )
    print(
        f"  LoRA / full: peak {lora['peak_bytes'] / max(full['peak_bytes'], 1):.3f}x, "
        f"step time {lora['step_s'] / full['step_s']:.3f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
