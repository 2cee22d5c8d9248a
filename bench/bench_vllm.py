"""Benchmark of the vLLM rollout plugin.

Measures, on one model and one set of prompts:

* rollout throughput (generated tokens / s) of the plugin's ``generate`` (vLLM + building
  the geartrain Batch) against raw ``vllm.LLM.generate`` on the *same* engine, prompts
  and sampling settings (the ratio is the plugin's overhead; goal >= 0.95), both as
  back-to-back pairs of whole calls and as the plugin's own work timed alone;
* the same for the core's ``torch`` rollout;
* weight sync: seconds and MB/s of ``update_weights`` with the full model;
* release / resume (CPU: engine shutdown and restart with the synced weights): seconds and
  resident memory before/after.

Run: ``.venvs/vllm/bin/python bench/bench_vllm.py`` (prints a JSON summary). Runs alternate
plugin and raw calls so background load hits both alike; the median of ``--repeats`` is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import replace
from typing import Any

from geartrain.config import RolloutConfig
from geartrain.layout import samples_batch
from geartrain.modeling import tiny_model
from geartrain.rollout import Rollout
from geartrain.types import EngineContext, SamplingParams
from geartrain_vllm.outputs import samples_from_outputs
from geartrain_vllm.requests import build_requests
from rollout_bench import Clock, bench_model, generated_tokens, make_prompts, median_rate, pair_ratios


def time_plugin(rollout: Rollout, prompts: list[list[int]], sampling: SamplingParams) -> tuple[float, float, int]:
    clock = Clock()
    batch = rollout.generate(prompts, sampling)
    return (*clock.stop(), generated_tokens(batch))


def time_raw_vllm(llm: Any, prompts: list[list[int]], sampling: SamplingParams) -> tuple[float, float, int]:
    """Raw ``LLM.generate`` with exactly the requests the plugin sends; no Batch built."""
    requests = build_requests(prompts, sampling)
    clock = Clock()
    outputs = llm.generate(requests.prompts, requests.params, use_tqdm=False)
    return (*clock.stop(), sum(len(c.token_ids) for o in outputs for c in o.outputs))


def plugin_overhead(llm: Any, prompts: list[list[int]], sampling: SamplingParams, repeats: int) -> dict[str, float]:
    """The plugin's own work around ``LLM.generate`` (building requests, reading the
    log-probs, laying out the Batch), timed alone on real outputs: unlike whole-call
    timings it does not drown in the engine's run-to-run noise on a shared machine."""
    engine_s, own_s = [], []
    for _ in range(repeats):
        clock = Clock()
        requests = build_requests(prompts, sampling)
        build = clock.stop()[0]
        clock = Clock()
        outputs = llm.generate(requests.prompts, requests.params, use_tqdm=False)
        engine_s.append(clock.stop()[0])
        clock = Clock()
        samples_batch(samples_from_outputs(prompts, requests.owners, outputs, sampling), 0)
        own_s.append(build + clock.stop()[0])
    engine, own = statistics.median(engine_s), statistics.median(own_s)
    return {
        "engine_generate_s": round(engine, 4),
        "plugin_own_s": round(own, 4),
        "plugin_over_raw_estimate": round(engine / (engine + own), 4),
    }


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
    parser.add_argument("--torch-repeats", type=int, default=2)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--out", help="also write the JSON summary here (vLLM logs to stdout too)")
    args = parser.parse_args()

    model, overrides = bench_model(args)
    prompts = make_prompts(args.prompts, args.prompt_len)
    sampling = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0)
    ctx = EngineContext(role="rollout")
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
    config = RolloutConfig(backend="vllm", max_model_len=args.max_model_len, kv_cache_bytes=256 << 20)
    rollout = Rollout(config, model, ctx)
    result["vllm_start_seconds"] = round(time.perf_counter() - start, 2)
    reference = tiny_model("qwen2", seed=0, **overrides)
    n_params = sum(p.numel() for p in reference.parameters())
    result["model"]["parameters"] = n_params

    # weight sync
    sync_runs = []
    for _ in range(args.syncs):
        rollout.update_weights((name, t.detach()) for name, t in reference.state_dict().items())
        stats = rollout.handle.last_sync
        sync_runs.append((stats.seconds, stats.bytes))
    seconds = statistics.median(s for s, _ in sync_runs)
    mb = sync_runs[0][1] / 1e6
    result["weight_sync"] = {
        "megabytes": round(mb, 1),
        "seconds_median": round(seconds, 4),
        "mb_per_s": round(mb / seconds, 1),
    }

    # throughput: warm-up, then alternate plugin / raw vLLM, seeded and unseeded requests
    for label, params in (("seeded", sampling), ("unseeded", replace(sampling, seed=None))):
        time_plugin(rollout, prompts, params)
        time_raw_vllm(rollout.handle.llm, prompts, params)
        plugin_runs, raw_runs = [], []
        for _ in range(args.repeats):
            plugin_runs.append(time_plugin(rollout, prompts, params))
            raw_runs.append(time_raw_vllm(rollout.handle.llm, prompts, params))
        if params.seed is not None:
            assert plugin_runs[0][2] == raw_runs[0][2], "plugin and raw vLLM must generate the same tokens"
        wall_pairs, cpu_pairs = pair_ratios(plugin_runs, raw_runs, False), pair_ratios(plugin_runs, raw_runs, True)
        result[f"throughput_{label}"] = {
            "tokens_per_generate": plugin_runs[0][2],
            "plugin_tokens_per_wall_s": round(median_rate(plugin_runs), 1),
            "raw_tokens_per_wall_s": round(median_rate(raw_runs), 1),
            "plugin_tokens_per_cpu_s": round(median_rate(plugin_runs, cpu=True), 1),
            "raw_tokens_per_cpu_s": round(median_rate(raw_runs, cpu=True), 1),
            "plugin_over_raw_wall": round(statistics.median(wall_pairs), 3),
            "plugin_over_raw_cpu": round(statistics.median(cpu_pairs), 3),
            "plugin_over_raw_cpu_pairs": [round(r, 3) for r in cpu_pairs],
        }
    plugin_wall = result["throughput_seeded"]["plugin_tokens_per_wall_s"]
    plugin_cpu = result["throughput_seeded"]["plugin_tokens_per_cpu_s"]

    result["overhead_seeded"] = plugin_overhead(rollout.handle.llm, prompts, sampling, args.repeats)

    # release / resume
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

    if not args.skip_torch:
        torch_rollout = Rollout(RolloutConfig(backend="torch", max_model_len=args.max_model_len), model, ctx)
        time_plugin(torch_rollout, prompts[:4], SamplingParams(n=1, max_tokens=4, seed=0))  # warm-up
        torch_runs = [time_plugin(torch_rollout, prompts, sampling) for _ in range(args.torch_repeats)]
        result["torch_rollout"] = {
            "tokens_per_wall_s": round(median_rate(torch_runs), 1),
            "tokens_per_cpu_s": round(median_rate(torch_runs, cpu=True), 1),
        }
        result["vllm_plugin_over_torch_wall"] = round(plugin_wall / median_rate(torch_runs), 2)
        result["vllm_plugin_over_torch_cpu"] = round(plugin_cpu / median_rate(torch_runs, cpu=True), 2)
        torch_rollout.shutdown()

    result["load_average_at_end"] = round(os.getloadavg()[0], 2)
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
