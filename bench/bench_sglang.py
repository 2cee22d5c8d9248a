"""Benchmark of the SGLang rollout plugin.

Measures, on one model and one set of prompts:

* rollout throughput (generated tokens / s) of the plugin's ``generate`` (SGLang + building
  the geartrain Batch) against raw ``sglang.Engine.generate`` on the *same* engine, with
  the *same* requests (the ratio is the plugin's overhead; goal >= 0.95), as back-to-back
  pairs of whole calls, plus the plugin's own work timed alone;
* weight sync: seconds and MB/s of ``update_weights`` with the full model, over both
  transports (``tensor``: shared memory; ``distributed``: a gloo group);
* release / resume (CPU: engine shutdown and restart with the synced weights): seconds and
  resident memory of this process plus the engine's;
* with ``--vllm-python``, the vLLM plugin on the same workload (``bench/bench_vllm.py``
  run by that interpreter, whose environment holds vLLM), for a side-by-side table;
* with ``--contention`` (only that): seconds per ``generate`` of the main job's step (its
  model, 16 prompts x 8 samples of <= 5 tokens) with the scheduler at each
  ``rollout.options.cpu_threads`` (torch's default, one per core; and 1), quiet and with
  ``--busy`` busy-looping processes competing for the cores, as a loaded machine does.

Run: ``.venvs/sglang/bin/python bench/bench_sglang.py [--vllm-python .venvs/vllm/bin/python]``
(prints a JSON summary). Plugin and raw calls alternate so background load hits both
alike; the median of ``--repeats`` is kept. CPU time is this process's plus the engine's
processes' (SGLang generates in its scheduler process).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from geartrain.config import ModelConfig, RolloutConfig
from geartrain.layout import check_generate_inputs, samples_batch
from geartrain.rollout import Rollout
from geartrain.testing.tiny import tiny_model
from geartrain.types import EngineContext, SamplingParams
from geartrain_sglang.outputs import samples_from_outputs
from geartrain_sglang.requests import build_requests
from rollout_bench import Clock, bench_model, generated_tokens, make_prompts, median_rate, pair_ratios


def time_plugin(rollout: Rollout, prompts: list[list[int]], sampling: SamplingParams) -> tuple[float, float, int]:
    clock = Clock(rollout.handle._pids)
    batch = rollout.generate(prompts, sampling)
    return (*clock.stop(), generated_tokens(batch))


def time_raw(rollout: Rollout, prompts: list[list[int]], sampling: SamplingParams) -> tuple[float, float, int]:
    """Raw ``Engine.generate`` with exactly the requests the plugin sends; no Batch built."""
    requests = build_requests(prompts, sampling, rollout.config.max_model_len)
    clock = Clock(rollout.handle._pids)
    outputs = rollout.handle.engine.generate(
        input_ids=requests.input_ids, sampling_params=requests.params, return_logprob=True
    )
    return (*clock.stop(), sum(len(o["output_ids"]) for o in outputs))


def plugin_overhead(
    rollout: Rollout, prompts: list[list[int]], sampling: SamplingParams, repeats: int
) -> dict[str, float]:
    """The plugin's own work around ``Engine.generate`` (checking the inputs, building
    requests, reading the log-probs, laying out the Batch), timed alone on real outputs."""
    engine_s, own_s = [], []
    eng = rollout.handle.engine
    for _ in range(repeats):
        start = time.perf_counter()
        check_generate_inputs(
            "sglang",
            prompts,
            sampling,
            max_model_len=rollout.config.max_model_len,
            vocab_size=rollout.handle.vocab_size,
        )
        requests = build_requests(prompts, sampling, rollout.config.max_model_len)
        build = time.perf_counter() - start
        start = time.perf_counter()
        outputs = eng.generate(input_ids=requests.input_ids, sampling_params=requests.params, return_logprob=True)
        engine_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        samples_batch(samples_from_outputs(prompts, requests.owners, outputs, sampling), 0)
        own_s.append(build + time.perf_counter() - start)
    engine, own = statistics.median(engine_s), statistics.median(own_s)
    return {
        "engine_generate_s": round(engine, 4),
        "plugin_own_s": round(own, 4),
        "plugin_over_raw_estimate": round(engine / (engine + own), 4),
    }


def weight_sync(rollout: Rollout, reference: torch.nn.Module, transport: str, syncs: int) -> dict[str, float]:
    rollout.handle.options.weight_sync = transport
    runs = []
    for _ in range(syncs):
        stats = rollout.handle.update_weights((n, t.detach()) for n, t in reference.state_dict().items())
        runs.append((stats.seconds, stats.bytes, stats.num_buckets))
    rollout.handle.options.weight_sync = "tensor"
    seconds = statistics.median(s for s, _, _ in runs)
    mb = runs[0][1] / 1e6
    return {
        "megabytes": round(mb, 1),
        "buckets": runs[0][2],
        "seconds_median": round(seconds, 4),
        "mb_per_s": round(mb / seconds, 1),
    }


def contention(args: argparse.Namespace) -> dict[str, Any]:
    """Per-call generate seconds of the main job's step, quiet and under ``args.busy``
    busy loops, for each scheduler thread count (see the module docstring)."""
    model = ModelConfig(
        tiny="qwen2",
        seed=0,
        config_overrides=dict(
            hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
        ),
    )
    prompts = make_prompts(16, 8)
    sampling = SamplingParams(n=8, temperature=1.0, max_tokens=5, seed=0)
    out: dict[str, Any] = {"busy_processes": args.busy, "calls": args.repeats}
    for threads in (None, 1):
        config = RolloutConfig(backend="sglang", max_model_len=32, options={"cpu_threads": threads})
        rollout = Rollout(config, model, EngineContext(role="rollout"))
        for _ in range(2):
            rollout.generate(prompts, sampling)  # warm-up
        row: dict[str, Any] = {}
        for label, busy in (("quiet", 0), ("busy", args.busy)):
            loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
            try:
                seconds = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    rollout.generate(prompts, sampling)
                    seconds.append(time.perf_counter() - start)
            finally:
                for loop in loops:
                    loop.kill()
                    loop.wait()
            row[label] = {
                "median_s": round(statistics.median(seconds), 3),
                "max_s": round(max(seconds), 3),
                "load_average": round(os.getloadavg()[0], 2),
            }
        rollout.shutdown()
        out["cpu_threads=" + ("default" if threads is None else str(threads))] = row
    return out


def run_vllm(args: argparse.Namespace) -> dict[str, Any]:
    """bench/bench_vllm.py on the same workload, in the interpreter that has vLLM."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "vllm.json"
        cmd = [args.vllm_python, str(Path(__file__).with_name("bench_vllm.py")), "--skip-torch", "--out", str(out)]
        for flag in (
            "hidden",
            "layers",
            "prompts",
            "prompt_len",
            "n",
            "max_tokens",
            "max_model_len",
            "repeats",
            "syncs",
        ):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=3600)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--vllm-python", help="interpreter of an environment with vLLM and geartrain-vllm")
    parser.add_argument("--out", help="also write the JSON summary here")
    parser.add_argument("--contention", action="store_true", help="only the generate-under-CPU-contention table")
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="busy loops for --contention")
    args = parser.parse_args()
    if args.contention:
        result = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU",
            "load_average_at_start": round(os.getloadavg()[0], 2),
            "contention": contention(args),
            "load_average_at_end": round(os.getloadavg()[0], 2),
        }
        print(json.dumps(result, indent=2))
        return

    model, overrides = bench_model(args)
    prompts = make_prompts(args.prompts, args.prompt_len)
    sampling = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU",
        "load_average_at_start": round(os.getloadavg()[0], 2),
        "model": {"family": "qwen2", **overrides, "vocab_size": 128},
        "workload": {
            "prompts": args.prompts,
            "n": args.n,
            "max_tokens": args.max_tokens,
            "prompt_len": args.prompt_len,
            "temperature": 1.0,
            "seeded": True,
        },
    }

    start = time.perf_counter()
    config = RolloutConfig(backend="sglang", max_model_len=args.max_model_len, kv_cache_bytes=256 << 20)
    rollout = Rollout(config, model, EngineContext(role="rollout"))
    result["sglang_start_seconds"] = round(time.perf_counter() - start, 2)
    reference = tiny_model("qwen2", seed=0, **overrides)
    result["model"]["parameters"] = sum(p.numel() for p in reference.parameters())

    result["weight_sync_tensor"] = weight_sync(rollout, reference, "tensor", args.syncs)
    result["weight_sync_distributed"] = weight_sync(rollout, reference, "distributed", args.syncs)

    for label, params in (("seeded", sampling), ("unseeded", replace(sampling, seed=None))):
        time_plugin(rollout, prompts, params)  # warm-up
        time_raw(rollout, prompts, params)
        plugin_runs, raw_runs = [], []
        for _ in range(args.repeats):
            plugin_runs.append(time_plugin(rollout, prompts, params))
            raw_runs.append(time_raw(rollout, prompts, params))
        if params.seed is not None:
            assert plugin_runs[0][2] == raw_runs[0][2], "plugin and raw SGLang must generate the same tokens"
        wall_pairs, cpu_pairs = pair_ratios(plugin_runs, raw_runs, False), pair_ratios(plugin_runs, raw_runs, True)
        result[f"throughput_{label}"] = {
            "tokens_per_generate": plugin_runs[0][2],
            "plugin_tokens_per_wall_s": round(median_rate(plugin_runs), 1),
            "raw_tokens_per_wall_s": round(median_rate(raw_runs), 1),
            "plugin_tokens_per_cpu_s": round(median_rate(plugin_runs, cpu=True), 1),
            "raw_tokens_per_cpu_s": round(median_rate(raw_runs, cpu=True), 1),
            "plugin_over_raw_wall": round(statistics.median(wall_pairs), 3),
            "plugin_over_raw_cpu": round(statistics.median(cpu_pairs), 3),
            "plugin_over_raw_wall_pairs": [round(r, 3) for r in wall_pairs],
        }
    result["overhead_seeded"] = plugin_overhead(rollout, prompts, sampling, args.repeats)

    released = rollout.release()
    resumed = rollout.resume()
    result["release"] = {
        "seconds": round(released.seconds, 2),
        "rss_before_mb": released.before // 2**20,
        "rss_after_mb": released.after // 2**20,
    }
    result["resume"] = {
        "seconds": round(resumed.seconds, 2),
        "rss_before_mb": resumed.before // 2**20,
        "rss_after_mb": resumed.after // 2**20,
    }
    rollout.shutdown()

    if args.vllm_python:
        vllm = run_vllm(args)
        result["vllm_same_workload"] = {
            "load_average_at_start": vllm.get("load_average_at_start"),
            "plugin_tokens_per_wall_s": vllm["throughput_seeded"]["plugin_tokens_per_wall_s"],
            "plugin_tokens_per_cpu_s": vllm["throughput_seeded"]["plugin_tokens_per_cpu_s"],
            "plugin_over_raw_wall": vllm["throughput_seeded"]["plugin_over_raw_wall"],
            "weight_sync_seconds": vllm["weight_sync"]["seconds_median"],
            "start_seconds": vllm.get("vllm_start_seconds"),
        }
    result["load_average_at_end"] = round(os.getloadavg()[0], 2)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text, file=sys.stdout)


if __name__ == "__main__":
    main()
