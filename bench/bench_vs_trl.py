"""geartrain vs TRL's ``GRPOTrainer`` on the main job's GRPO phase, side by side in one run.

    make bench-trl                                   # builds .venvs/trl, then runs this
    .venvs/trl/bin/python bench/bench_vs_trl.py --threads 1 2 --steps 100
    .venvs/trl/bin/python bench/bench_vs_trl.py --threads 2 --to-accuracy 0.9 --async

Both sides start from one SFT checkpoint (the main job's warm start, exported by geartrain
once, or ``--sft-dir``) and train with the main job's hyper-parameters: 16 prompts x 8
samples, 5 new tokens at temperature 1, GRPO advantages (group mean / std), clip 0.2,
token-mean loss, no KL, AdamW (lr 3e-4, warmup 50, cosine to 10 % at step 1200, clip 1.0),
fp32, SDPA attention, no vLLM. Fairness checks, each printed and enforced (the run stops if
one fails):

* same checkpoint: the greedy tokens on all 256 held-out prompts at step 0 are identical
  (geartrain through its own rollout, TRL through ``model.generate``);
* same prompts in the same order: TRL's dataset is geartrain's loader order with TRL's
  shuffling off, and the prompts TRL's reward sees at each step are compared with it;
* same learning rate at every step (TRL gets the same schedule as a ``LambdaLR``; HF's
  cosine warmup would start one step later).

Per step, each side's own loop is timed with the wall clock and the process CPU clock;
held-out accuracy is measured every ``--eval-every`` steps by one shared greedy evaluator,
outside the timed steps. "Time to X %" sums the step times up to the first evaluation at
or above X. Results go to stdout as a markdown table (paste into bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
MAIN_CONFIG = ROOT / "examples" / "arithmetic" / "grpo.toml"
sys.path.insert(0, str(MAIN_CONFIG.parent))
from geartrain.config import ModelConfig  # noqa: E402
from geartrain.modeling import load_tokenizer  # noqa: E402
from geartrain.trainer.config import TrainConfig, load_train_config  # noqa: E402
from geartrain.trainer.metrics import JsonlLogger  # noqa: E402
from geartrain.trainer.preflight import preflight  # noqa: E402
from geartrain.trainer.rl import RLTrainer  # noqa: E402
from geartrain.trainer.run import Job  # noqa: E402
from geartrain.types import SamplingParams  # noqa: E402
from task import exact_match  # noqa: E402  (the main job's reward)

try:  # the optimizer code moves into the core (geartrain.optim)
    from geartrain.optim import lr_factor
except ImportError:  # pragma: no cover
    from geartrain_fsdp.optim import lr_factor


@dataclass
class Side:
    """One framework's run."""

    name: str
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)
    """``(step, held-out accuracy)``; step 0 is the start."""
    rewards: list[float] = field(default_factory=list)

    def seconds_to(self, accuracy: float, clock: str = "wall") -> float | None:
        times = self.wall if clock == "wall" else self.cpu
        for step, acc in self.evals:
            if acc >= accuracy:
                return sum(times[:step])
        return None


def config(out: Path, threads: int, extra: list[str] = ()) -> TrainConfig:
    return load_train_config(
        MAIN_CONFIG,
        [
            f"trainer.output_dir={out}",
            f"trainer.torch_threads={threads}",
            "trainer.tensorboard=false",
            "trainer.progress=false",
            "trainer.export_hf=false",
            "trainer.plot=false",
            *extra,
        ],
    )


def sft_checkpoint(out: Path) -> Path:
    """The main job's SFT warm start, exported as a Hugging Face directory."""
    cfg = config(out, threads=torch.get_num_threads())
    pre = preflight(cfg)
    job = Job(cfg, reward_fn=pre.reward, echo=lambda line: print(f"  {line}"))
    out.mkdir(parents=True, exist_ok=True)
    jsonl = JsonlLogger(out / "sft.jsonl")
    policy = job._sft(pre, jsonl, None)
    jsonl.close()
    return Path(policy.path)


# ---------------------------------------------------------------------- shared evaluator
@torch.no_grad()
def greedy_tokens(model: torch.nn.Module, prompts: list[list[int]], eos: int, max_new: int = 5) -> list[list[int]]:
    """Greedy continuations (up to and including EOS) of ``prompts`` under ``model``."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out: list[list[int]] = [[] for _ in prompts]
    done = torch.zeros(len(prompts), dtype=torch.bool)
    was_training = model.training
    model.eval()
    for _ in range(max_new):
        pos = (att.cumsum(1) - 1).clamp(min=0)
        nxt = model(input_ids=ids, attention_mask=att, position_ids=pos).logits[:, -1].argmax(-1)
        for i in range(len(prompts)):
            if not done[i]:
                out[i].append(int(nxt[i]))
        done |= nxt == eos
        ids = torch.cat([ids, nxt[:, None]], 1)
        att = torch.cat([att, (~done | (nxt == eos)).long()[:, None]], 1)
        if bool(done.all()):
            break
    model.train(was_training)
    return out


def accuracy(model: torch.nn.Module, tokenizer: Any, rows: list[Any]) -> float:
    eos = tokenizer.eos_token_id
    outs = greedy_tokens(model, [r.prompt_ids for r in rows], eos)
    texts = tokenizer.batch_decode([[t for t in o if t != eos] for o in outs], skip_special_tokens=True)
    return sum(exact_match(t, r.ground_truth)["acc"] for t, r in zip(texts, rows, strict=True)) / len(rows)


def cut_at_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


# ---------------------------------------------------------------------- geartrain
def run_geartrain(
    sft: Path, threads: int, steps: int, eval_every: int, target: float | None, out: Path, *, async_rollout: bool
) -> tuple[Side, list[list[int]], list[list[str]]]:
    # async: the budget is split between the training and the generating thread (torch's
    # intra-op thread count applies to each Python thread)
    per_thread = max(1, threads // 2) if async_rollout else threads
    torch.set_num_threads(per_thread)
    cfg = config(out, per_thread, ["sft.enabled=false", f"trainer.async_rollout={str(async_rollout).lower()}"])
    policy = ModelConfig(path=str(sft))
    tokenizer = load_tokenizer(policy)
    pre = preflight(cfg, tokenizer=tokenizer)
    job = Job(cfg, reward_fn=pre.reward)
    loader, val = job._data(pre)
    order_loader, _ = job._data(pre)  # the same seed: the prompts in training order
    order = [[r.prompt for r in order_loader.next_batch().rows] for _ in range(steps + cfg.trainer.max_staleness + 1)]
    roles = job.build_roles(policy)
    trainer = RLTrainer(cfg, roles, tokenizer, loader)
    assert val is not None
    rows = val.rows
    eos = tokenizer.eos_token_id
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=cfg.sampling.max_tokens, stop_token_ids=[eos], seed=0)
    batch, _ = roles.actor.call("generate", [r.prompt_ids for r in rows], greedy)
    mask = batch["response_mask"].bool()
    tokens0 = [cut_at_eos(batch["input_ids"][i][mask[i]].tolist(), eos) for i in range(len(rows))]
    from transformers import AutoModelForCausalLM

    trained = roles.actor.worker.engine.handle.hf  # runs the engine's packed attention
    evaluator = AutoModelForCausalLM.from_pretrained(str(sft), dtype=torch.float32, attn_implementation="sdpa")

    def evaluate() -> float:
        evaluator.load_state_dict(trained.state_dict())
        return accuracy(evaluator, tokenizer, rows)

    side = Side("geartrain" + (" async" if async_rollout else ""))
    side.evals.append((0, evaluate()))
    for step in range(1, steps + 1):
        w, c = time.perf_counter(), time.process_time()
        metrics = trainer.step(step)
        side.wall.append(time.perf_counter() - w)
        side.cpu.append(time.process_time() - c)
        side.lrs.append(metrics["actor/lr"])
        side.rewards.append(metrics["reward/mean"])
        if step % eval_every == 0:
            side.evals.append((step, evaluate()))
            if target is not None and side.evals[-1][1] >= target:
                break
    for group in (roles.actor, roles.reward):
        group.shutdown()
    return side, tokens0, order


# ---------------------------------------------------------------------- TRL
def run_trl(
    sft: Path, threads: int, steps: int, eval_every: int, target: float | None, out: Path, order: list[list[str]]
) -> tuple[Side, list[list[int]], list[list[str]]]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    cfg = config(out, threads)
    optim, sampling = cfg.actor.engine.optim, cfg.sampling
    tokenizer = load_tokenizer(ModelConfig(path=str(sft)))
    pre = preflight(cfg, tokenizer=tokenizer)
    val = pre.datasets.get("validation.path")
    assert val is not None
    rows = val.rows
    eos = tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(str(sft), dtype=torch.float32, attn_implementation="sdpa")

    answers = {r.prompt: r.ground_truth for r in pre.datasets["data.path"].rows}
    data = Dataset.from_list([{"prompt": p, "ground_truth": answers[p]} for batch in order for p in batch])
    seen: list[list[str]] = []
    side = Side("TRL")

    def reward(prompts: list[str], completions: list[str], ground_truth: list[str], **_: Any) -> list[float]:
        seen.append(list(prompts[:: sampling.n]))
        scores = [exact_match(c, g)["score"] for c, g in zip(completions, ground_truth, strict=True)]
        side.rewards.append(statistics.fmean(scores))
        return scores

    opt = torch.optim.AdamW(
        model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, optim))
    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=cfg.data.batch_size * sampling.n,
        num_generations=sampling.n,
        max_completion_length=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=1.0,
        beta=0.0,
        epsilon=cfg.algorithm.clip_ratio,
        loss_type="dapo",  # token-mean over the whole batch, as geartrain's token-mean
        learning_rate=optim.lr,
        max_grad_norm=optim.clip_grad,
        max_steps=optim.total_steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        shuffle_dataset=False,
        seed=cfg.trainer.seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    clock: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            side.lrs.append(float(sched.get_last_lr()[0]))
            clock["w"], clock["c"] = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            side.wall.append(time.perf_counter() - clock["w"])
            side.cpu.append(time.process_time() - clock["c"])
            step = state.global_step
            if step % eval_every == 0:
                side.evals.append((step, accuracy(model, tokenizer, rows)))
                if target is not None and side.evals[-1][1] >= target:
                    control.should_training_stop = True
            if step >= steps:
                control.should_training_stop = True
            return control

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[Clock()],
        optimizers=(opt, sched),
    )
    trainer.remove_callback(PrinterCallback)  # no log line per step on stdout
    prompts = [r.prompt_ids for r in rows]
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id or 0] * (width - len(p)) + p for p in prompts])
    att = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    with torch.no_grad():
        gen = model.generate(
            input_ids=ids,
            attention_mask=att,
            do_sample=False,
            max_new_tokens=sampling.max_tokens,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id or 0,
        )
    tokens0 = [cut_at_eos(g[width:].tolist(), eos) for g in gen]
    side.evals.append((0, accuracy(model, tokenizer, rows)))
    trainer.train()
    return side, tokens0, seen


# ---------------------------------------------------------------------- report
def summary(side: Side, target: float) -> dict[str, Any]:
    skip = min(10, len(side.wall) // 2)  # warm-up steps
    return {
        "steps": len(side.wall),
        "wall_s_per_step": statistics.median(side.wall[skip:]),
        "cpu_s_per_step": statistics.median(side.cpu[skip:]),
        "mean_reward": statistics.fmean(side.rewards) if side.rewards else float("nan"),
        "accuracy": side.evals[-1][1],
        "to_target_wall_s": side.seconds_to(target, "wall"),
        "to_target_cpu_s": side.seconds_to(target, "cpu"),
        "evals": side.evals,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=100, help="GRPO steps per run (upper bound with --to-accuracy)")
    ap.add_argument("--to-accuracy", type=float, default=None, help="stop each run once held-out accuracy reaches this")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument(
        "--async", dest="async_rollout", action="store_true", help="also run geartrain with trainer.async_rollout"
    )
    ap.add_argument("--sft-dir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = ap.parse_args()
    target = args.to_accuracy or 0.9

    import transformers
    import trl

    transformers.utils.logging.disable_progress_bar()

    work = Path(tempfile.mkdtemp(prefix="bench_vs_trl_"))
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  {platform.machine()}  {os.cpu_count()} cores  "
        f"load(1 min) {os.getloadavg()[0]:.1f}  torch {torch.__version__}  "
        f"transformers {transformers.__version__}  trl {trl.__version__}"
    )
    sft = args.sft_dir or sft_checkpoint(work / "sft")
    results: dict[str, Any] = {}
    for threads in args.threads:
        gear, g_tokens, order = run_geartrain(
            sft, threads, args.steps, args.eval_every, args.to_accuracy, work / f"g{threads}", async_rollout=False
        )
        trl_side, t_tokens, seen = run_trl(
            sft, threads, args.steps, args.eval_every, args.to_accuracy, work / f"t{threads}", order
        )
        sides = [gear, trl_side]
        if args.async_rollout and threads >= 2:
            sides.append(
                run_geartrain(
                    sft,
                    threads,
                    args.steps,
                    args.eval_every,
                    args.to_accuracy,
                    work / f"a{threads}",
                    async_rollout=True,
                )[0]
            )
        # fairness checks
        same_tokens = sum(a == b for a, b in zip(g_tokens, t_tokens, strict=True))
        assert same_tokens == len(g_tokens), (
            f"step-0 greedy tokens differ on {len(g_tokens) - same_tokens} held-out prompts"
        )
        assert gear.evals[0][1] == trl_side.evals[0][1], (gear.evals[0], trl_side.evals[0])
        assert seen == order[: len(seen)], "TRL saw other prompts (or another order) than geartrain"
        n = min(len(gear.lrs), len(trl_side.lrs))
        worst_lr = max(abs(a - b) for a, b in zip(gear.lrs[:n], trl_side.lrs[:n], strict=True))
        assert worst_lr < 1e-12, f"lr schedules differ by {worst_lr}"
        print(
            f"\nthreads {threads}: fairness ok (greedy tokens identical on {same_tokens} held-out prompts, "
            f"start accuracy {100 * gear.evals[0][1]:.1f} %, {len(seen)} steps of identical prompts, "
            f"lr equal at {n} steps)"
        )
        print(
            "| side | steps | s/step wall (median) | s/step CPU | vs TRL (wall) | mean train reward | final acc | "
            f"time to {100 * target:.0f} % wall / CPU |"
        )
        print("|---|---|---|---|---|---|---|---|")
        ref = summary(trl_side, target)
        for side in sides:
            s = summary(side, target)
            results[f"{side.name}@{threads}"] = s
            to = (
                "-"
                if s["to_target_wall_s"] is None
                else f"{s['to_target_wall_s']:.1f} s / {s['to_target_cpu_s']:.1f} s"
            )
            print(
                f"| {side.name} | {s['steps']} | {s['wall_s_per_step']:.4f} | {s['cpu_s_per_step']:.4f} | "
                f"{s['wall_s_per_step'] / ref['wall_s_per_step']:.2f} | {s['mean_reward']:.4f} | "
                f"{100 * s['accuracy']:.1f} % | {to} |"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
