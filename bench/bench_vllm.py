"""Benchmark of the vLLM rollout plugin.

Measures, on one model and one set of prompts:

* rollout throughput (generated tokens / s) of the plugin's ``generate`` (vLLM + building
  the geartrain Batch) against raw ``vllm.LLM.generate`` on the *same* engine, prompts
  and sampling settings (the ratio is the plugin's overhead; goal >= 0.95);
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
import platform
import statistics
import time
from dataclasses import replace
from typing import Any

import torch
from geartrain.config import ModelConfig, RolloutConfig
from geartrain.rollout import Rollout
from geartrain.testing.tiny import tiny_model
from geartrain.types import EngineContext, SamplingParams


def bench_model(args: argparse.Namespace) -> tuple[ModelConfig, dict[str, Any]]:
    overrides = dict(
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=args.max_model_len,
    )
    return ModelConfig(tiny="qwen2", seed=0, config_overrides=overrides), overrides


def make_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        n = max(4, length - (i % 8))  # a few different lengths
        prompts.append([1] + torch.randint(4, 128, (n - 1,), generator=gen).tolist())
    return prompts


def generated_tokens(batch) -> int:  # noqa: ANN001
    return int(batch["response_mask"].sum())


def time_plugin(rollout: Rollout, prompts: list[list[int]], sampling: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    batch = rollout.generate(prompts, sampling)
    return time.perf_counter() - start, generated_tokens(batch)


def time_raw_vllm(llm: Any, prompts: list[list[int]], sampling: SamplingParams) -> tuple[float, int]:
    """Raw vLLM with exactly the requests the plugin sends (per-prompt seeded params)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt

    def params(i: int) -> VllmSamplingParams:
        return VllmSamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=max(sampling.top_k, 0),
            max_tokens=sampling.max_tokens,
            seed=None if sampling.seed is None else sampling.seed + i * sampling.n,
            logprobs=0,
            flat_logprobs=True,
            ignore_eos=True,
            detokenize=False,
        )

    start = time.perf_counter()
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    per_prompt = [params(i) for i in range(len(prompts))] if sampling.seed is not None else params(0)
    outputs = llm.generate(requests, per_prompt, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(c.token_ids) for o in outputs for c in o.outputs)


def median_rate(runs: list[tuple[float, int]]) -> float:
    return statistics.median(tokens / seconds for seconds, tokens in runs)


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
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
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
    result["weight_sync"] = {"megabytes": round(mb, 1), "seconds_median": round(seconds, 4), "mb_per_s": round(mb / seconds, 1)}

    # throughput: warm-up, then alternate plugin / raw vLLM, seeded and unseeded requests
    for label, params in (("seeded", sampling), ("unseeded", replace(sampling, seed=None))):
        time_plugin(rollout, prompts, params)
        time_raw_vllm(rollout.handle.llm, prompts, params)
        plugin_runs, raw_runs = [], []
        for _ in range(args.repeats):
            plugin_runs.append(time_plugin(rollout, prompts, params))
            raw_runs.append(time_raw_vllm(rollout.handle.llm, prompts, params))
        if params.seed is not None:
            assert plugin_runs[0][1] == raw_runs[0][1], "plugin and raw vLLM must generate the same tokens"
        pair_ratios = [(pt / ps) / (rt / rs) for (ps, pt), (rs, rt) in zip(plugin_runs, raw_runs)]
        result[f"throughput_{label}"] = {
            "tokens_per_generate": plugin_runs[0][1],
            "vllm_plugin_tokens_per_s": round(median_rate(plugin_runs), 1),
            "vllm_raw_tokens_per_s": round(median_rate(raw_runs), 1),
            "plugin_over_raw_median_of_pairs": round(statistics.median(pair_ratios), 3),
            "plugin_over_raw_pairs": [round(r, 3) for r in pair_ratios],
        }
    plugin_rate = result["throughput_seeded"]["vllm_plugin_tokens_per_s"]

    # release / resume
    released = rollout.release()
    resumed = rollout.resume()
    result["release"] = {"seconds": round(released.seconds, 2), "rss_before_mb": released.before // 2**20, "rss_after_mb": released.after // 2**20}
    result["resume"] = {"seconds": round(resumed.seconds, 2), "rss_before_mb": resumed.before // 2**20, "rss_after_mb": resumed.after // 2**20}
    rollout.shutdown()

    if not args.skip_torch:
        torch_rollout = Rollout(RolloutConfig(backend="torch", max_model_len=args.max_model_len), model, ctx)
        time_plugin(torch_rollout, prompts[:4], SamplingParams(n=1, max_tokens=4, seed=0))  # warm-up
        torch_runs = [time_plugin(torch_rollout, prompts, sampling) for _ in range(args.torch_repeats)]
        torch_rate = median_rate(torch_runs)
        result["torch_rollout_tokens_per_s"] = round(torch_rate, 1)
        result["vllm_plugin_over_torch"] = round(plugin_rate / torch_rate, 2)
        torch_rollout.shutdown()

    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
