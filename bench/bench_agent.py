"""Episodes per second of the asynchronous episode runner vs a round-synchronous loop, side
by side in one run, with tools that take 0 ms, 50 ms and 500 ms on average.

Both loops run the same episodes (the same tiny model on the torch rollout, the same seeds,
``--turns`` tool calls each, then a final answer) and the same tool latencies: each call
sleeps a time drawn for its (episode, turn), either ``exponential`` (mean = the latency:
network tools, a long tail) or ``constant``. The round-synchronous baseline is what a loop
without a scheduler does: generate one turn for every live episode, run all their tool
calls concurrently, wait for the *slowest*, repeat. The asynchronous runner
(:class:`geartrain.agents.EpisodeRunner`) generates for whichever episodes are ready and
runs the tools while the model generates.

    .venv/bin/python bench/bench_agent.py [--episodes 128] [--turns 4] [--repeats 3]

The default is a main-job-sized step: 16 tasks x 8 episodes, 4 tool calls each.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from geartrain import EngineContext, ModelConfig, Rollout, RolloutConfig, SamplingParams
from geartrain.agents import EpisodeRunner, RunnerLimits, StepResult
from geartrain.agents.runner import TURN_STRIDE
from geartrain.agents.trajectory import Episode, Segment
from geartrain.testing.tiny import tiny_tokenizer

MAX_MODEL_LEN = 128
TOKENS_PER_TURN = 8


def latency(episode: int, turn: int, mean_s: float, kind: str) -> float:
    if mean_s == 0:
        return 0.0
    if kind == "constant":
        return mean_s
    return random.Random(episode * 7919 + turn).expovariate(1.0 / mean_s)


class SlowTool:
    """Every model turn is a tool call that sleeps its latency; after ``turns`` calls the
    episode is done."""

    def __init__(self, turns: int, mean_s: float, kind: str) -> None:
        self.turns, self.mean_s, self.kind = turns, mean_s, kind
        self.k = 0
        self.episode = 0

    def reset(self, task: dict[str, Any]) -> str:
        self.episode = int(task["episode"])
        return ""

    def step(self, action: str) -> StepResult:
        self.k += 1
        if self.k > self.turns:
            return StepResult(done=True)
        time.sleep(latency(self.episode, self.k, self.mean_s, self.kind))
        return StepResult(
            observation=f"(result {self.k})", info={"tool_calls": 1, "tool_errors": 0, "tool_latencies_s": []}
        )


def round_synchronous(
    rollout: Rollout, tok: Any, prompts: list[list[int]], turns: int, mean_s: float, kind: str, seed: int
) -> list[Episode]:
    """The baseline: one synchronous round per turn, waiting for every episode's tool."""
    episodes = [Episode(index=i, group=i, prompt_ids=p, task={"episode": i}) for i, p in enumerate(prompts)]
    envs = [SlowTool(turns, mean_s, kind) for _ in episodes]
    for ep, env in zip(episodes, envs, strict=True):
        env.reset(ep.task)
    pool = ThreadPoolExecutor(max_workers=len(episodes))
    live = list(range(len(episodes)))
    while live:
        sampling = SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=TOKENS_PER_TURN,
            stop_token_ids=[tok.eos_token_id],
            prompt_indices=[episodes[i].index * TURN_STRIDE + episodes[i].model_turns for i in live],
        )
        batch = rollout.generate([episodes[i].token_ids() for i in live], sampling)
        width = batch.info["prompt_length"]
        for row, i in enumerate(live):
            n = int(batch["response_mask"][row].sum())
            ids = batch["input_ids"][row, width : width + n].tolist()
            episodes[i].segments.append(Segment(kind="model", ids=ids, text=tok.decode(ids)))
        results = list(pool.map(lambda i: envs[i].step(episodes[i].segments[-1].text), live))  # waits for the slowest
        still = []
        for i, result in zip(live, results, strict=True):
            if result.done:
                episodes[i].done = True
            else:
                episodes[i].segments.append(
                    Segment(
                        kind="observation",
                        ids=tok.encode(result.observation, add_special_tokens=False),
                        text=result.observation,
                    )
                )
                still.append(i)
        live = still
    pool.shutdown()
    return episodes


def asynchronous(
    rollout: Rollout, tok: Any, prompts: list[list[int]], turns: int, mean_s: float, kind: str, seed: int
) -> list[Episode]:
    runner = EpisodeRunner(
        rollout.generate,
        tok,
        lambda: SlowTool(turns, mean_s, kind),
        RunnerLimits(max_turns=turns + 1, max_tokens_per_turn=TOKENS_PER_TURN, max_model_len=MAX_MODEL_LEN),
        workers=len(prompts),
    )
    episodes, _ = runner.run(
        prompts,
        [{"episode": i} for i in range(len(prompts))],
        SamplingParams(temperature=1.0, seed=seed, stop_token_ids=[tok.eos_token_id]),
    )
    return episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=128)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latencies-ms", type=str, default="0,50,500")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tok = tiny_tokenizer()
    rollout = Rollout(
        RolloutConfig(backend="torch", max_model_len=MAX_MODEL_LEN),
        ModelConfig(tiny="qwen2", seed=0),
        EngineContext(role="rollout"),
    )
    prompts = [[tok.bos_token_id, *tok.encode(f"task {i}:", add_special_tokens=False)] for i in range(args.episodes)]
    print(
        f"# bench_agent: {args.episodes} episodes x {args.turns} tool calls (+ a final turn), "
        f"{TOKENS_PER_TURN} tokens a turn, torch threads {args.threads}, load {os.getloadavg()[0]:.2f}"
    )
    print("| tool latency | distribution | round-synchronous episodes/s | asynchronous episodes/s | speed-up |")
    print("|---|---|---|---|---|")
    for ms in [int(x) for x in args.latencies_ms.split(",")]:
        for kind in ["exponential", "constant"] if ms else ["none"]:
            rates: dict[str, list[float]] = {"sync": [], "async": []}
            for rep in range(args.repeats):
                for name, fn in (("sync", round_synchronous), ("async", asynchronous)):  # interleaved
                    start = time.perf_counter()
                    eps = fn(rollout, tok, prompts, args.turns, ms / 1000, kind, seed=rep)
                    rates[name].append(len(eps) / (time.perf_counter() - start))
            sync, asyn = statistics.median(rates["sync"]), statistics.median(rates["async"])
            print(f"| {ms} ms | {kind} | {sync:.2f} | {asyn:.2f} | {asyn / sync:.2f}x |", flush=True)
    rollout.shutdown()


if __name__ == "__main__":
    main()
