"""The GPU figures of issue 33 in one run of at most 8 minutes (driver:
``bench/gpu/run_issue33_on_device.sh``), counted by :mod:`geartrain.accounting`.

Sections, in this order, each skipped once the time budget (``--budget``, default 450 s) is
spent, each in a process of its own on CUDA (a crash or a hang costs that section only),
each printing ``name: value`` lines (all of them in ``$OUT/issue33.json``):

1. ``decode``: the torch rollout on qwen2.5-0.5b, batch 256, 256-token prompts + 256 new
   tokens, per ``--decode-variants`` (``<decode_attention>:<decode_graph>``; default
   ``gqa:forward hf:forward``: the GQA-native decode attention against transformers'
   ``sdpa``, which expands the cache): tokens/s and the fraction of the roofline
   ``max(bytes / bandwidth, 2 N B / peak)`` summed over the steps with the live KV bytes
   (goal >= 35 %), the bytes per step, and what the static cache's full width would read;
2. ``mfu05`` / ``mfu15``: the fsdp engine's update (forward + backward + fused AdamW) on
   qwen2.5-0.5b / 1.5b, 24 sequences of 1-2k tokens, bf16 on a one-rank FSDP2 mesh,
   ``options.compile`` (on by default on CUDA), the fused log-prob head: MFU by the
   accounting (6 N per computed token + causal attention; goals >= 35 % / >= 45 %), also in
   torchtitan/verl's ``s^2`` convention;
3. ``grpo``: the GRPO step on qwen2.5-0.5b, 64 prompts x 8, 256 + 256 tokens, geartrain
   (torch rollout + fsdp engine, colocated; goal <= 2.5 s on an H200) and TRL's
   GRPOTrainer on the same shapes in the same call, with the update phase's MFU counted on
   the computed tokens (each prompt once per group);
4. ``lora_memory``: ``bench/bench_lora.py`` on qwen2.5-1.5b at equal micro-batch with
   gradient checkpointing, full fine-tuning vs LoRA r16 (bf16 base): peaks (weights
   included) and their ratio (goal <= 0.35x).
5. ``decode_skewed``: decode as in 1 (gqa:forward) with length-skewed per-row budgets
   (Pareto, 32-256 tokens at 256), finished rows left in the batch vs compacted every
   ``--compact-every`` steps (``rollout.options.compact_every``).

``--device cpu --dry-run`` runs the sections on the tiny model with small shapes (the CPU
check of this script; ``tests/fsdp_engine/test_gpu_script_issue33.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import issue20_check as base  # noqa: E402 - the issue-20 script's helpers (record, card, engines)

RESULTS = base.RESULTS
record, card, sync = base.record, base.card, base.sync


def _shape(model_cfg: Any) -> Any:
    from geartrain.accounting import ModelShape
    from geartrain.modeling import hf_config

    return ModelShape.from_config(hf_config(model_cfg))


def _model(a: argparse.Namespace, preset: str) -> Any:
    from geartrain.config import ModelConfig

    return ModelConfig(tiny="qwen2") if a.dry_run else ModelConfig(preset=preset)


# --------------------------------------------------------------------------- 1. decode
def skewed_budgets(rows: int, most: int) -> list[int]:
    """Length-skewed per-row token budgets (Pareto, shape 1.2, scale ``most / 8``, at most
    ``most``), fixed by the seed: a few long rows and many short ones, as RL rollouts with
    stop tokens finish."""
    g = torch.Generator().manual_seed(33)
    u = torch.rand(rows, generator=g, dtype=torch.float64).clamp_min(1e-9)
    low = max(1, most // 8)
    return [int(min(most, low * x)) for x in (u ** (-1 / 1.2)).tolist()]


def decode(a: argparse.Namespace, *, skewed: bool = False) -> None:
    """Decode at ``a.decode_batch`` rows, each ``--decode-variants`` entry; ``skewed``:
    length-skewed budgets (:func:`skewed_budgets`), gqa:forward without and with the
    compaction of finished rows (``rollout.options.compact_every``)."""
    from geartrain.accounting import decode_call_roofline, decode_step_bytes
    from geartrain.config import RolloutConfig
    from geartrain.rollout import Rollout
    from geartrain.types import EngineContext, SamplingParams

    mc = _model(a, "qwen2.5-0.5b")
    shape = _shape(mc)
    _, peak, bw = card(a.device)
    rows = a.decode_batch
    budgets = skewed_budgets(rows, a.response_tokens) if skewed else None
    variants = [f"gqa:forward:{k}" for k in (0, a.compact_every)] if skewed else a.decode_variants
    for variant in variants:
        attention, graph, *rest = variant.split(":")
        compact = int(rest[0]) if rest else 0
        ro = Rollout(
            RolloutConfig(
                backend="torch",
                dtype="bfloat16" if a.device == "cuda" else "float32",
                max_model_len=a.prompt_tokens + a.response_tokens,
                max_num_seqs=rows,
                options={
                    "static_cache": True,
                    "decode_graph": graph,
                    "decode_attention": attention,
                    "compact_every": compact,
                },
            ),
            mc,
            EngineContext(role="rollout", device=a.device),
        )
        model = ro.handle.model
        itemsize = next(model.parameters()).element_size()
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        g = torch.Generator().manual_seed(rows)
        prompts = [torch.randint(4, 100, (a.prompt_tokens,), generator=g).tolist() for _ in range(rows)]
        sp = SamplingParams(
            n=1,
            temperature=1.0,
            max_tokens=a.response_tokens,
            seed=0,
            stop_token_ids=[],
            max_tokens_per_prompt=budgets,
        )
        t = time.perf_counter()
        ro.generate(prompts, sp)  # warm-up: compiles and captures for these shapes
        sync(a.device)
        warm = time.perf_counter() - t
        t = time.perf_counter()
        out = ro.generate(prompts, sp)
        sync(a.device)
        dt = time.perf_counter() - t
        generated = out["response_mask"].sum(1).tolist()
        roof = decode_call_roofline(
            shape, weight_bytes, [a.prompt_tokens] * rows, generated, itemsize, bw if bw == bw else 1.0, peak
        )
        full_width = decode_step_bytes(shape, weight_bytes, [a.prompt_tokens + a.response_tokens] * rows, itemsize)
        figures = {
            "decode_attention": model.config._attn_implementation,
            "decode_graph": graph,
            "compact_every": compact,
            "batch": rows,
            "generated_tokens": int(sum(generated)),
            "seconds_incl_prefill": round(dt, 3),
            "tokens_per_s": round(sum(generated) / dt),
            "ms_per_step": round(dt / max(generated) * 1e3, 3),
            "roofline_s": round(roof["seconds"], 4) if bw == bw else None,
            "fraction_of_roofline": round(roof["seconds"] / dt, 3) if bw == bw else None,
            "live_bytes_per_step_mean": int(roof["mean_bytes_per_step"]),
            "static_width_bytes_per_step": full_width,
            "warmup_s": round(warm, 1),
            "mean_abs_logp_vs_hf_forward": round(base.logp_gap_vs_forward(model, out), 5),
        }
        tag = f"skewed_compact{compact}" if skewed else f"{attention}_{graph}"
        record(f"decode_{tag}_batch{rows}", figures)
        ro.shutdown()
        del ro, model
    if skewed:
        off, on = (RESULTS.get(f"decode_skewed_compact{k}_batch{rows}") for k in (0, a.compact_every))
        if isinstance(off, dict) and isinstance(on, dict):
            record(
                "decode_skewed_compaction_speedup", round(off["seconds_incl_prefill"] / on["seconds_incl_prefill"], 3)
            )
        return
    gqa, hf = RESULTS.get(f"decode_gqa_forward_batch{rows}"), RESULTS.get(f"decode_hf_forward_batch{rows}")
    if isinstance(gqa, dict) and isinstance(hf, dict):
        record("decode_gqa_over_hf_speedup", round(gqa["tokens_per_s"] / hf["tokens_per_s"], 3))


# --------------------------------------------------------------------------- 2. update MFU
def update_mfu(a: argparse.Namespace, preset: str, micro_tokens: int) -> None:
    import random

    from geartrain.accounting import computed_tokens, update_flops
    from geartrain.testing.reference import token_mean_nll_loss

    engine, mc = base.make_engine(a, preset, micro_tokens, share_prompt_prefix=False)
    shape = _shape(mc)
    g = random.Random(0)
    lengths = [g.randint(a.seq_min, a.seq_max) for _ in range(a.mfu_rows)]
    prompt = 64 if not a.dry_run else 4
    batch = base.token_batch(a.mfu_rows, lengths, prompt, min(shape.vocab, 30000), seed=1)
    rows = [(prompt, n - prompt) for n in lengths]
    _, peak, _ = card(a.device)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(1 + a.steps):
        sync(a.device)
        t = time.perf_counter()
        engine.forward_backward(batch, token_mean_nll_loss)
        stats = engine.optimizer_step()
        sync(a.device)
        if i:
            times.append(time.perf_counter() - t)
        else:
            record(f"mfu_{preset}_first_step_s", round(time.perf_counter() - t, 2))
    step = sorted(times)[len(times) // 2]
    flops, square = update_flops(shape, rows), update_flops(shape, rows, convention="square")
    opts = engine.handle.options
    record(
        f"mfu_{preset}",
        {
            "matmul_params": shape.matmul_params,
            "computed_tokens": computed_tokens(rows),
            "micro_batch_tokens": micro_tokens,
            "step_s": round(step, 4),
            "tflops_per_s": round(flops / step / 1e12, 1),
            "mfu": round(flops / step / peak, 3) if peak == peak else None,
            "mfu_square_convention": round(square / step / peak, 3) if peak == peak else None,
            "attention_share_of_flops": round(1 - 6 * shape.matmul_params * computed_tokens(rows) / flops, 3),
            "grad_norm": stats.get("grad_norm"),
            "attention_kernel": engine.handle.attention_kernel,
            "compiled": opts.compiles(engine.handle.device),
            "one_rank_mesh": engine.handle.meshes.distributed,
            "fused_log_probs": opts.fused_log_probs,
            "fused_adamw": bool(engine.handle.optimizer.defaults.get("fused")),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if a.device == "cuda" else None,
        },
    )


# --------------------------------------------------------------------------- 3. GRPO step
def grpo(a: argparse.Namespace, which: str) -> None:
    from geartrain.accounting import computed_tokens, update_flops

    if which == "trl":
        base.grpo_trl(a)
        return
    a.grpo_compile = "on" if a.device == "cuda" else "off"
    base.grpo_geartrain(a)
    ours = RESULTS.get("grpo_geartrain")
    if not isinstance(ours, dict):
        return
    shape = _shape(_model(a, "qwen2.5-0.5b"))
    rows = [(a.prompt_tokens, a.response_tokens)] * (a.grpo_prompts * a.n)  # no stop tokens: full length
    groups = [i // a.n for i in range(len(rows))]
    _, peak, _ = card(a.device)
    flops = update_flops(shape, rows, groups)
    record(
        "grpo_update_accounting",
        {
            "computed_tokens": computed_tokens(rows, groups),
            "counted_tokens_without_sharing": computed_tokens(rows),
            "update_tflop": round(flops / 1e12, 2),
            "update_mfu": round(flops / ours["update_s"] / peak, 3) if peak == peak and ours.get("update_s") else None,
        },
    )


# --------------------------------------------------------------------------- 4. LoRA memory
def lora_memory(a: argparse.Namespace) -> None:
    """bench_lora.py's two children (full, LoRA) at the same micro-batch, both with
    gradient checkpointing."""
    model = "tiny" if a.dry_run else "qwen2.5-1.5b"
    shape = (
        [
            "--rows",
            "8",
            "--samples",
            "4",
            "--prompt-tokens",
            "8",
            "--response-tokens",
            "8",
            "--micro-batch-tokens",
            "64",
        ]
        if a.dry_run
        else ["--rows", "64", "--samples", "8", "--prompt-tokens", "256", "--response-tokens", "256"]
        + ["--micro-batch-tokens", "16384", "--lora-base-dtype", "bfloat16"]
    )
    with tempfile.TemporaryDirectory(prefix="issue33-lora-") as tmp:
        out = os.path.join(tmp, "lora.json")
        cmd = [sys.executable, os.path.join(HERE, "..", "bench_lora.py"), "--model", model, "--device", a.device]
        cmd += [*shape, "--steps", "2", "--gradient-checkpointing", "--json", out]
        left = max(30.0, a.budget - (time.perf_counter() - base.START))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        print(proc.stdout[-2000:], proc.stderr[-2000:] if proc.returncode else "", flush=True)
        if proc.returncode != 0:
            record("lora_memory_error", f"bench_lora.py exit {proc.returncode}: {proc.stderr[-300:]}")
            return
        with open(out) as f:
            full, lora = json.load(f)["results"]
    record(
        "lora_memory",
        {
            "model": model,
            "gradient_checkpointing": True,
            "full_peak_gib": round(full["peak_bytes"] / 2**30, 3),
            "lora_peak_gib": round(lora["peak_bytes"] / 2**30, 3),
            "lora_over_full_peak": round(lora["peak_bytes"] / max(full["peak_bytes"], 1), 3),
            "full_step_s": round(full["step_s"], 3),
            "lora_step_s": round(lora["step_s"], 3),
            "peaks_include_weights": True,
        },
    )


# --------------------------------------------------------------------------- driver
SECTIONS = ["decode", "mfu05", "grpo_geartrain", "grpo_trl", "mfu15", "lora_memory", "decode_skewed"]


def run_sections(a: argparse.Namespace) -> None:
    table = {
        "decode": lambda: decode(a),
        "decode_skewed": lambda: decode(a, skewed=True),
        "mfu05": lambda: update_mfu(a, "qwen2.5-0.5b", a.micro_tokens),
        "mfu15": lambda: update_mfu(a, "qwen2.5-1.5b", a.micro_tokens // 2),
        "grpo_geartrain": lambda: grpo(a, "geartrain"),
        "grpo_trl": lambda: grpo(a, "trl"),
        "lora_memory": lambda: lora_memory(a),
    }
    for key in a.sections:
        base.section(key, a.budget, table[key])


def run_isolated(a: argparse.Namespace, argv: list[str]) -> None:
    """Each section in a child process of this script, killed with its process group
    when the budget left (plus ``--child-grace``) runs out; its figures are merged as far
    as it wrote them."""
    for key in a.sections:
        left = a.budget - (time.perf_counter() - base.START)
        if left <= 0:
            record(f"{key}_skipped", "time budget spent")
            continue
        fd, path = tempfile.mkstemp(prefix=f"issue33-{key}-", suffix=".json")
        os.close(fd)
        os.unlink(path)
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--sections", key, "--no-isolate"]
        cmd += ["--budget", str(left), "--child-results", path]
        proc = subprocess.Popen(cmd, start_new_session=True)
        try:
            rc: Any = proc.wait(timeout=left + a.child_grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "killed at the budget: a hang?"
        if os.path.exists(path):
            with open(path) as f:
                child = json.load(f)
            os.unlink(path)
            child.pop("device", None)
            RESULTS.update(child)
        if rc != 0:
            record(f"{key}_error", f"child process: {rc}")
    ours, trl = RESULTS.get("grpo_geartrain"), RESULTS.get("grpo_trl")
    if isinstance(ours, dict) and isinstance(trl, dict):
        record("grpo_geartrain_over_trl", round(ours["step_s"] / trl["step_s"], 3))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dry-run", action="store_true", help="tiny model and shapes (the CPU check of this script)")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds; later sections are skipped after it")
    ap.add_argument("--sections", nargs="+", default=SECTIONS, choices=SECTIONS)
    ap.add_argument(
        "--decode-variants",
        nargs="+",
        default=["gqa:forward", "hf:forward"],
        help="<decode_attention>:<decode_graph> pairs (gqa|hf : step|forward|none)",
    )
    ap.add_argument("--grpo-decode-graph", default="forward", choices=["step", "forward", "none"])
    ap.add_argument("--compact-every", type=int, default=32, help="decode_skewed: the compaction period (steps)")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="the MFU and GRPO engines")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None, help="default: on CUDA")
    ap.add_argument("--child-grace", type=float, default=30.0)
    ap.add_argument("--child-results", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for variant in a.decode_variants:
        attention, _, graph = variant.partition(":")
        if attention not in ("gqa", "hf") or graph not in ("step", "forward", "none"):
            print(f"--decode-variants: {variant!r} is not <gqa|hf>:<step|forward|none>", file=sys.stderr)
            return 2
    if a.child_results:
        base.CHILD_RESULTS = a.child_results
    big = not a.dry_run
    a.steps = 3 if big else 1
    a.seq_min, a.seq_max = (1024, 2048) if big else (16, 32)
    a.mfu_rows = 24 if big else 6
    a.prompt_tokens, a.response_tokens = (256, 256) if big else (8, 8)
    a.decode_batch = 256 if big else 8
    a.grpo_prompts, a.n = (64, 8) if big else (4, 4)
    a.micro_tokens = 16384 if big else 256
    a.isolate = a.device == "cuda" if a.isolate is None else a.isolate
    if not a.child_results:
        name, peak, bw = card(a.device)
        record("device", {"name": name, "bf16_peak_flops": peak, "hbm_bytes_per_s": bw, "torch": torch.__version__})
    if a.isolate:
        parent_args = [x for x in argv if x not in ("--isolate",)]
        if "--sections" in parent_args:  # each child gets its own section
            i = parent_args.index("--sections")
            j = i + 1
            while j < len(parent_args) and not parent_args[j].startswith("--"):
                j += 1
            parent_args = parent_args[:i] + parent_args[j:]
        run_isolated(a, parent_args)
    else:
        run_sections(a)
    if a.child_results:
        return 0
    ours, trl = RESULTS.get("grpo_geartrain"), RESULTS.get("grpo_trl")
    if isinstance(ours, dict) and isinstance(trl, dict):
        record("grpo_geartrain_over_trl", round(ours["step_s"] / trl["step_s"], 3))
    record("total_s", round(time.perf_counter() - base.START, 1))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "issue33.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
