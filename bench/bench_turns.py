"""Benchmark: what prefix caching saves a rollout on multi-turn (agent) episodes.

A multi-turn episode is generated turn by turn: each turn is a ``generate`` call on every
token so far (task prompt, earlier model turns, observations), so without a prefix cache
every turn prefills the whole history again. This bench runs the same episodes through
the same rollout backend with its prefix cache on and off:

* ``--backend vllm``: ``enable_prefix_caching`` on with 32-token KV blocks, on with vLLM's
  CPU default of 128-token blocks, and off;
* ``--backend sglang``: the radix cache on (SGLang's default) and off
  (``disable_radix_cache``).

Workload (one "step", as the trainer runs it): the weights are synced (which resets the
cache, as after every optimizer step), then ``--episodes`` episodes of ``--turns`` turns:
turn ``t`` generates ``--turn-tokens`` tokens (seeded, temperature 1; one sample per
episode, the agent runner's layout) from the episode's history, then ``--obs-tokens``
fixed observation tokens are appended. The task prompts are ``--prompt-len`` tokens.
Every configuration must produce the same tokens (checked); the figure is wall and CPU seconds
(this process and its children) per step, median over ``--repeats`` x ``--steps``,
configurations interleaved round by round, each round with fresh engines so no
configuration runs warmer than another.

Run: ``.venvs/vllm/bin/python bench/bench_turns.py --backend vllm`` or
``.venvs/sglang/bin/python bench/bench_turns.py --backend sglang`` (prints JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from typing import Any

import psutil
import torch
from geartrain.config import ModelConfig, RolloutConfig
from geartrain.modeling import tiny_model
from geartrain.rollout import Rollout
from geartrain.testing.rollout_suite import named_tensors, responses
from geartrain.types import EngineContext, SamplingParams

CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "vllm": {
        "prefix_cache_block32": {"engine_kwargs": {"block_size": 32}},
        "prefix_cache_block128": {},
        "no_prefix_cache": {"enable_prefix_caching": False},
    },
    "sglang": {
        "radix_cache": {},
        "no_radix_cache": {"engine_kwargs": {"disable_radix_cache": True}},
    },
}


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


def random_tokens(count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 128, (length,), generator=gen).tolist() for _ in range(count)]


def cpu_seconds() -> float:
    """CPU time of this process and its children so far (vLLM runs in this process,
    SGLang's scheduler in a child): on a shared machine the stable measure of work done."""
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += sum(child.cpu_times()[:2])
    return total


def run_step(
    rollout: Rollout, reference: torch.nn.Module, args: argparse.Namespace
) -> tuple[float, float, list[list[int]]]:
    """Sync the weights (resets the cache), then all episodes' turns; returns the wall and
    CPU seconds of the turns and the episodes' final token ids."""
    rollout.update_weights(named_tensors(reference))
    history = [[1, *p] for p in random_tokens(args.episodes, args.prompt_len - 1, seed=0)]
    start, cpu = time.perf_counter(), cpu_seconds()
    for turn in range(args.turns):
        sampling = SamplingParams(
            temperature=1.0,
            max_tokens=args.turn_tokens,
            seed=0,
            # a stream per (episode, turn), whatever else is batched
            prompt_indices=[turn * args.episodes + e for e in range(args.episodes)],
        )
        generated = responses(rollout.generate(history, sampling))
        observations = random_tokens(args.episodes, args.obs_tokens, seed=1 + turn)
        history = [h + g + o for h, g, o in zip(history, generated, observations, strict=True)]
    return time.perf_counter() - start, cpu_seconds() - cpu, history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=sorted(CONFIGS), required=True)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--obs-tokens", type=int, default=48)
    parser.add_argument("--max-model-len", type=int, default=640)
    parser.add_argument("--repeats", type=int, default=3, help="rounds (fresh engines each)")
    parser.add_argument("--steps", type=int, default=2, help="steps timed per engine (the median is kept)")
    parser.add_argument("--out", help="also write the JSON summary here")
    args = parser.parse_args()

    need = args.prompt_len + args.turns * (args.turn_tokens + args.obs_tokens)
    if need > args.max_model_len:
        raise SystemExit(f"episodes reach {need} tokens; raise --max-model-len")
    model, overrides = bench_model(args)
    reference = tiny_model("qwen2", seed=0, **overrides)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU",
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": round(os.getloadavg()[0], 2),
        "backend": args.backend,
        "model": {"family": "qwen2", **overrides, "vocab_size": 128},
        "workload": {k: getattr(args, k) for k in ("episodes", "turns", "prompt_len", "turn_tokens", "obs_tokens")},
        "episode_tokens_at_end": need,
    }
    times: dict[str, list[float]] = {name: [] for name in CONFIGS[args.backend]}
    cpu_times: dict[str, list[float]] = {name: [] for name in CONFIGS[args.backend]}
    finals: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for name, options in CONFIGS[args.backend].items():
            config = RolloutConfig(
                backend=args.backend,
                max_model_len=args.max_model_len,
                max_num_seqs=args.episodes,
                kv_cache_bytes=256 << 20,
                options={"seed": 0, **options},
            )
            rollout = Rollout(config, model, EngineContext(role="rollout"))
            try:
                run_step(rollout, reference, args)  # warm-up
                for _ in range(args.steps):
                    seconds, cpu, final = run_step(rollout, reference, args)
                    times[name].append(seconds)
                    cpu_times[name].append(cpu)
                    finals.setdefault(name, final)
            finally:
                rollout.shutdown()
    base = next(iter(finals.values()))
    result["same_tokens_in_every_configuration"] = all(f == base for f in finals.values())
    for label, measured in (("wall", times), ("cpu", cpu_times)):
        medians = {name: statistics.median(t) for name, t in measured.items()}
        uncached = next(m for name, m in medians.items() if name.startswith("no_"))
        result[f"step_{label}_seconds_median"] = {name: round(m, 3) for name, m in medians.items()}
        result[f"step_{label}_seconds_all"] = {name: [round(x, 3) for x in t] for name, t in measured.items()}
        result[f"{label}_speedup_over_no_cache"] = {name: round(uncached / m, 2) for name, m in medians.items()}
    result["load_average_at_end"] = round(os.getloadavg()[0], 2)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
