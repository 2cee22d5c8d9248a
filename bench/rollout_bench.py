"""What the rollout benchmarks share (``bench_vllm.py``, ``bench_sglang.py``): the
benchmark model, the prompts, the clock, and the rate summaries. One definition, so the two
backends are measured on the same workload the same way."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterable
from typing import Any

import torch
from geartrain.config import ModelConfig


def bench_model(args: argparse.Namespace) -> tuple[ModelConfig, dict[str, Any]]:
    """A tiny qwen2 of ``args.hidden`` width and ``args.layers`` layers (heads of 64)."""
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
    """``count`` prompts of a few different lengths up to ``length`` (BOS 1, then ids in 4..127)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        n = max(4, length - (i % 8))  # a few different lengths
        prompts.append([1] + torch.randint(4, 128, (n - 1,), generator=gen).tolist())
    return prompts


def generated_tokens(batch) -> int:  # noqa: ANN001
    return int(batch["response_mask"].sum())


class Clock:
    """Wall time and CPU time of this process (all threads) plus ``pids`` (an engine's own
    processes: SGLang generates in its scheduler process, vLLM in-process). On a shared
    machine the CPU time is the stable measure of the work done."""

    def __init__(self, pids: Iterable[int] = ()) -> None:
        import psutil

        self.procs = [psutil.Process()] + [psutil.Process(p) for p in pids]
        self.wall, self.cpu = time.perf_counter(), self._cpu()

    def _cpu(self) -> float:
        total = 0.0
        for proc in self.procs:
            t = proc.cpu_times()
            total += t.user + t.system
        return total

    def stop(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, self._cpu() - self.cpu


def median_rate(runs: list[tuple[float, float, int]], cpu: bool = False) -> float:
    """Median tokens per wall second (or per CPU second) of ``(wall_s, cpu_s, tokens)`` runs."""
    return statistics.median(tokens / (cpu_s if cpu else wall_s) for wall_s, cpu_s, tokens in runs)


def pair_ratios(plugin: list[tuple[float, float, int]], raw: list[tuple[float, float, int]], cpu: bool) -> list[float]:
    """Plugin rate over raw rate for each back-to-back pair of runs."""
    k = 1 if cpu else 0
    return [(p[2] / p[k]) / (r[2] / r[k]) for p, r in zip(plugin, raw, strict=True)]
