"""Every GPU check of issue 20 in one run (driver: ``bench/gpu/run_issue20_on_device.sh``).

Sections, in order of priority, each skipped once the time budget (``--budget``, default
500 s) is spent, each reporting its figures as ``name: value`` lines (and all of them in
``$OUT/issue20.json``):

1. attention: the FSDP engine's GPU kernels (flash-attn varlen when installed, compiled
   flex_attention) against SDPA on packed and shared-prompt rows in bf16, forward and
   backward, and their speed;
2. update MFU on qwen2.5-0.5b (and 3. on qwen2.5-1.5b): the fsdp engine's
   forward+backward+AdamW on sequences of 1-2k tokens in bf16 (fp32 master weights),
   MFU = 6 N tokens / step time / the card's dense bf16 peak; with the decoder layers eager
   and compiled (``options.compile``; ``--compile off on``, the default, measures both);
4. decode: the torch rollout (static KV cache, CUDA graphs) generating 256 tokens after
   256-token prompts at batch 64 and 256 on qwen2.5-0.5b, tokens/s and the fraction of the
   memory-bandwidth bound (weights + the KV cache read once per step / HBM bandwidth);
5. GRPO step on qwen2.5-0.5b, 64 prompts x 8 samples, 256 + 256 tokens (and geartrain alone
   at 256 + 1024): geartrain
   (torch rollout + fsdp engine, colocated) and, when trl imports, TRL's GRPOTrainer with
   its own generate on the same model and batch; also the trainer-rollout mismatch
   (mean |logp_trainer - logp_rollout| over response tokens, bf16 both sides);
6. memory: ``geartrain bench memory`` phases on qwen2.5-0.5b and the largest preset whose
   update runs, with and without CPU offload and gradient checkpointing (what time is left).

``--device cpu --dry-run`` runs every section on the tiny model with small shapes: the
CPU check that the script and its code paths work (``make`` runs nothing of it on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

RESULTS: dict[str, Any] = {}
START = time.perf_counter()
#: Where a child process (``--isolate``) writes its figures after each one, so that what it
#: measured before a crash or a hang still reaches the parent.
CHILD_RESULTS: str | None = None

#: Dense bf16 tensor FLOP/s and HBM bytes/s by card name (NVIDIA data sheets, SXM parts).
CARDS = {
    "H200": (989.4e12, 4.8e12),
    "H100 PCIe": (756.0e12, 2.0e12),
    "H100 NVL": (835.0e12, 3.9e12),
    "H100": (989.4e12, 3.35e12),
    "A100": (312.0e12, 2.04e12),
}


def record(name: str, value: Any) -> None:
    RESULTS[name] = value
    print(f"{name}: {value}", flush=True)
    if CHILD_RESULTS:
        with open(CHILD_RESULTS + ".tmp", "w") as f:
            json.dump(RESULTS, f, default=str)
        os.replace(CHILD_RESULTS + ".tmp", CHILD_RESULTS)


def card(device: str) -> tuple[str, float, float]:
    if device != "cuda":
        return "cpu", float("nan"), float("nan")
    name = torch.cuda.get_device_name(0)
    for key, (flops, bw) in CARDS.items():
        if key in name:
            return name, flops, bw
    return name, float("nan"), float("nan")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def section(name: str, budget: float, fn: Callable[[], None]) -> None:
    left = budget - (time.perf_counter() - START)
    if left <= 0:
        record(f"{name}_skipped", "time budget spent")
        return
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # report and go on: the sections are independent
        import traceback

        traceback.print_exc()
        record(f"{name}_error", repr(exc)[:400])
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    record(f"{name}_section_s", round(time.perf_counter() - t0, 1))


# --------------------------------------------------------------------------- 1. attention
def attention(a: argparse.Namespace) -> None:
    from geartrain_fsdp import attention_kernels as ak
    from geartrain_fsdp.prefix_sharing import Segment, SegmentAttention, segment_attention
    from geartrain_fsdp.ulysses import varlen_causal_attention

    dev, dtype = a.device, (torch.bfloat16 if a.device == "cuda" else torch.float32)
    heads, kv, d = (14, 2, 64) if not a.dry_run else (4, 2, 16)
    g = torch.Generator().manual_seed(0)
    lengths = [int(x) for x in torch.randint(a.seq_min, a.seq_max + 1, (a.attn_seqs,), generator=g)]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    segs, start = [], 0
    for _ in range(max(1, a.attn_seqs // 8)):
        p, rs = a.prompt_tokens, [a.response_tokens] * 8
        segs.append(Segment(start=start, prefix=p, responses=rs))
        start += p + sum(rs)
    record("attention_flash_installed", ak.flash_available())
    record("attention_flash_impl", (ak._flash_function() or ("none",))[0])
    for layout_name, n in (("packed", cu[-1]), ("shared_prompts", start)):
        q, k, v = (torch.randn(1, h, n, d, device=dev, dtype=dtype, requires_grad=True) for h in (heads, kv, kv))
        w = torch.randn(1, heads, n, d, device=dev, dtype=dtype)
        if layout_name == "packed":
            ref_fn = lambda q=q, k=k, v=v: varlen_causal_attention(q, k, v, cu, None)  # noqa: E731
            labels, varlen = ak.packed_labels(cu, dev), ak.varlen_layout(cu_seqlens=cu, device=dev)
        else:
            sa = SegmentAttention.build(segs, torch.device(dev))
            ref_fn = lambda q=q, k=k, v=v, sa=sa: segment_attention(q, k, v, sa, None)  # noqa: E731
            labels, varlen = ak.shared_labels(segs, dev), ak.varlen_layout(segments=segs, device=dev)
        ref = ref_fn()
        ref_grads = torch.autograd.grad((ref.float() * w.float()).sum(), (q, k, v))
        kernels: dict[str, Callable[[], torch.Tensor]] = {"sdpa": ref_fn}
        if dev == "cuda":
            mask = ak.flex_block_mask(labels)
            kernels["flex"] = lambda q=q, k=k, v=v, mask=mask: ak.flex_attention_call(q, k, v, mask, None)
            if ak.flash_available():
                kernels["flash"] = lambda q=q, k=k, v=v, varlen=varlen: ak.flash_varlen(q, k, v, varlen, None)
        else:  # CPU: flash's layout through SDPA (flex has no CPU backward)
            kernels["flash_layout_via_sdpa"] = lambda q=q, k=k, v=v, varlen=varlen: ak.flash_varlen(
                q, k, v, varlen, None, kernel=ak.varlen_reference
            )
        for kname, fn in kernels.items():
            out = fn()
            grads = torch.autograd.grad((out.float() * w.float()).sum(), (q, k, v))
            err = float((out.detach().float() - ref.detach().float()).abs().max())
            gerr = max(float((x.float() - y.float()).abs().max()) for x, y in zip(grads, ref_grads, strict=True))
            sync(dev)
            t0 = time.perf_counter()
            reps = 5 if not a.dry_run else 1
            for _ in range(reps):
                out = fn()
                torch.autograd.grad((out.float() * w.float()).sum(), (q, k, v))
            sync(dev)
            ms = (time.perf_counter() - t0) / reps * 1e3
            record(
                f"attention_{layout_name}_{kname}",
                {"tokens": n, "max_err_vs_sdpa": err, "grad_max_err": gerr, "fwd_bwd_ms": round(ms, 2)},
            )


# --------------------------------------------------------------------------- 2/3. update MFU
def token_batch(rows: int, lengths: list[int], prompt: int, vocab: int, seed: int):  # noqa: ANN201
    from geartrain.layout import sequence_batch

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths[:rows]]
    return sequence_batch([s[:prompt] for s in seqs], [s[prompt:] for s in seqs], 0, mask_key="loss_mask")


def make_engine(a: argparse.Namespace, model: str, micro_tokens: int, **options: Any):  # noqa: ANN201
    from geartrain.cluster.process_group import acquire_single_rank_group
    from geartrain.config import EngineConfig, ModelConfig, OptimConfig
    from geartrain.engine import Engine
    from geartrain.types import EngineContext

    mc = ModelConfig(tiny="qwen2") if a.dry_run else ModelConfig(preset=model)
    cfg = EngineConfig(
        backend="fsdp",
        param_dtype="bfloat16",
        max_tokens_per_micro_batch=micro_tokens,
        gradient_checkpointing=a.gradient_checkpointing,
        optim=OptimConfig(lr=1e-6),
        options=options,
    )
    group = acquire_single_rank_group(a.device)
    return Engine(cfg, mc, EngineContext(role="actor", device=a.device, process_group=group)), mc


def update_mfu(a: argparse.Namespace, model: str, micro_tokens: int) -> None:
    """The update's MFU with each ``--compile`` variant (``off``: eager layers, key
    ``mfu_<model>``; ``on``: ``options.compile``, key ``mfu_<model>_compiled``), each on its
    own engine over the same batch; with both, their step-time ratio."""
    for variant in a.compile:
        update_mfu_variant(a, model, micro_tokens, compiled=variant == "on")
    off, on = RESULTS.get(f"mfu_{model}"), RESULTS.get(f"mfu_{model}_compiled")
    if isinstance(off, dict) and isinstance(on, dict):
        record(f"mfu_{model}_compile_speedup", round(off["step_s"] / on["step_s"], 3))


def update_mfu_variant(a: argparse.Namespace, model: str, micro_tokens: int, *, compiled: bool) -> None:
    from geartrain.testing.reference import token_mean_nll_loss

    key = f"mfu_{model}_compiled" if compiled else f"mfu_{model}"
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    options: dict[str, Any] = {"share_prompt_prefix": False, "compile": compiled}
    if compiled:
        options.update(compile_backend=a.compile_backend)
    engine, _ = make_engine(a, model, micro_tokens, **options)
    record(f"{key}_build_s", round(time.perf_counter() - t0, 1))
    n_params = sum(p.numel() for p in engine.handle.hf.parameters())
    vocab = engine.handle.hf.config.vocab_size
    g = random.Random(0)
    lengths = [g.randint(a.seq_min, a.seq_max) for _ in range(a.mfu_rows)]
    batch = token_batch(a.mfu_rows, lengths, 64 if not a.dry_run else 4, min(vocab, 30000), seed=1)
    tokens = int(batch["attention_mask"].sum())
    _, peak, _ = card(a.device)
    times = []
    for i in range(1 + a.steps):
        sync(a.device)
        t = time.perf_counter()
        engine.forward_backward(batch, token_mean_nll_loss)
        stats = engine.optimizer_step()
        sync(a.device)
        if i:  # the first step warms up (kernel compilation, torch.compile, allocator)
            times.append(time.perf_counter() - t)
        else:
            record(f"{key}_first_step_s", round(time.perf_counter() - t, 2))
    step = sorted(times)[len(times) // 2]
    if a.profile_update:
        record(f"{key}_profile_top_ops", profile_update(a, engine, batch))
    flops = 6 * n_params * tokens
    record(
        key,
        {
            "parameters": n_params,
            "tokens_per_step": tokens,
            "micro_batch_tokens": micro_tokens,
            "step_s": round(step, 4),
            "tokens_per_s": round(tokens / step),
            "achieved_tflops": round(flops / step / 1e12, 1),
            "mfu": round(flops / step / peak, 3) if peak == peak else None,
            "grad_norm": stats.get("grad_norm"),
            "attention_kernel": engine.handle.attention_kernel,
            "compile": engine.handle.options.compile_backend if compiled else "off",
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if a.device == "cuda" else None,
        },
    )
    del engine


def profile_update(a: argparse.Namespace, engine: Any, batch: Any) -> list[str]:
    """Where one update step's time goes (forward + backward + AdamW): the fifteen most
    expensive ops by device time (CPU time off CUDA), from torch.profiler."""
    from geartrain.testing.reference import token_mean_nll_loss
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    with profile(activities=acts) as prof:
        engine.forward_backward(batch, token_mean_nll_loss)
        engine.optimizer_step()
        sync(a.device)
    key = "device_time_total" if a.device == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=60)
    print(table, flush=True)
    return table.splitlines()[:21]


# --------------------------------------------------------------------------- 4. decode
def make_rollout(a: argparse.Namespace, model_cfg: Any, rows: int, static: bool, graph: str | None = None):  # noqa: ANN201
    from geartrain.config import RolloutConfig
    from geartrain.rollout import Rollout
    from geartrain.types import EngineContext

    options: dict[str, Any] = {"static_cache": static}
    if graph is not None:
        options["decode_graph"] = graph
    return Rollout(
        RolloutConfig(
            backend="torch",
            dtype="bfloat16" if a.device == "cuda" else "float32",
            max_model_len=a.prompt_tokens + a.response_tokens,
            max_num_seqs=rows,
            options=options,
        ),
        model_cfg,
        EngineContext(role="rollout", device=a.device),
    )


def kv_bytes_per_token(cfg: Any, itemsize: int) -> int:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * itemsize


@torch.no_grad()
def logp_gap_vs_forward(model: torch.nn.Module, batch: Any, rows: int = 16) -> float:
    """Mean |rollout log-prob - a plain forward's| over the response tokens of the first
    ``rows`` rows: a wrong decode (a stale cache position, a misplaced mask) shows here."""
    ids, mask = batch["input_ids"][:rows], batch["attention_mask"][:rows]
    resp, lp = batch["response_mask"][:rows].bool(), batch["rollout_log_probs"][:rows]
    dev = next(model.parameters()).device
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev)).logits.float()
    ref = torch.zeros(lp.shape)  # aligned like rollout_log_probs: column t is log p(ids[t] | ids[:t])
    ref[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:].to(dev).unsqueeze(-1)).squeeze(-1).cpu()
    return float((ref[resp] - lp[resp]).abs().mean())


def decode(a: argparse.Namespace) -> None:
    from geartrain.config import ModelConfig
    from geartrain.types import SamplingParams

    mc = ModelConfig(tiny="qwen2") if a.dry_run else ModelConfig(preset="qwen2.5-0.5b")
    _, _, bw = card(a.device)
    for rows in a.decode_batches:
        for graph in a.decode_graphs:
            static = graph != "dynamic"
            ro = make_rollout(a, mc, rows, static, None if not static else graph)
            model = ro.handle.model
            n_params = sum(p.numel() for p in model.parameters())
            itemsize = next(model.parameters()).element_size()
            g = torch.Generator().manual_seed(rows)
            prompts = [torch.randint(4, 100, (a.prompt_tokens,), generator=g).tolist() for _ in range(rows)]
            tokens = a.response_tokens if static else min(64, a.response_tokens)
            sp = SamplingParams(n=1, temperature=1.0, max_tokens=tokens, seed=0, stop_token_ids=[])
            t = time.perf_counter()
            ro.generate(prompts, sp)  # warm-up: compiles and captures the graphs for these shapes
            sync(a.device)
            warm = time.perf_counter() - t
            t = time.perf_counter()
            out = ro.generate(prompts, sp)
            sync(a.device)
            dt = time.perf_counter() - t
            generated = int(out["response_mask"].sum())
            mean_ctx = a.prompt_tokens + tokens / 2
            step_bytes = n_params * itemsize + rows * mean_ctx * kv_bytes_per_token(model.config, itemsize)
            bound = rows / (step_bytes / bw)
            figures = {
                "generated_tokens": generated,
                "seconds": round(dt, 3),
                "tokens_per_s": round(generated / dt),
                "ms_per_decode_step": round(dt / tokens * 1e3, 3),
                "bandwidth_bound_tokens_per_s": round(bound) if bw == bw else None,
                "fraction_of_bound": round(generated / dt / bound, 3) if bw == bw else None,
                "warmup_s": round(warm, 1),
                "prompt_tokens": a.prompt_tokens,
                "includes_prefill": True,
                "mean_abs_logp_vs_hf_forward": round(logp_gap_vs_forward(model, out), 5),
            }
            if a.profile_decode and rows == a.decode_batches[0]:
                figures["profile_top_ops"] = profile_decode(a, ro, prompts, sp)
            record(f"decode_batch{rows}_{graph}", figures)
            ro.shutdown()


def profile_decode(a: argparse.Namespace, ro: Any, prompts: list[list[int]], sp: Any) -> list[str]:
    """Where a decode call's time goes: the ten most expensive ops by device time (CPU
    time off CUDA), from torch.profiler over one generate call."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    with profile(activities=acts) as prof:
        ro.generate(prompts, sp)
        sync(a.device)
    key = "device_time_total" if a.device == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=10, max_name_column_width=50)
    print(table, flush=True)
    return table.splitlines()[:16]


# --------------------------------------------------------------------------- 5. GRPO step
def grpo_geartrain(a: argparse.Namespace, response_tokens: int | None = None) -> None:
    from geartrain.algorithms import ActorLossConfig, compute_advantages, make_actor_loss
    from geartrain.types import SamplingParams

    tokens = response_tokens or a.response_tokens
    tag = "" if response_tokens is None else f"_{tokens}"
    options = {"compile": True, "compile_backend": a.compile_backend} if a.grpo_compile == "on" else {"compile": False}
    engine, mc = make_engine(a, "qwen2.5-0.5b", a.micro_tokens, **options)
    a_saved, a.response_tokens = a.response_tokens, tokens
    ro = make_rollout(a, mc, a.grpo_prompts * a.n, static=a.device == "cuda", graph=a.grpo_decode_graph)
    a.response_tokens = a_saved
    g = torch.Generator().manual_seed(7)
    loss_fn = make_actor_loss(ActorLossConfig())
    times, mismatch = [], []
    phases: dict[str, list[float]] = {"sync_weights_s": [], "generate_s": [], "update_s": []}
    for step in range(1 + a.steps):
        prompts = [torch.randint(4, 100, (a.prompt_tokens,), generator=g).tolist() for _ in range(a.grpo_prompts)]
        sp = SamplingParams(n=a.n, temperature=1.0, max_tokens=tokens, seed=step, stop_token_ids=[])
        sync(a.device)
        t = time.perf_counter()
        engine.sync_weights(ro)
        sync(a.device)
        t_synced = time.perf_counter()
        batch = ro.generate(prompts, sp)
        sync(a.device)
        t_generated = time.perf_counter()
        mask = batch["response_mask"]
        scores = torch.rand(len(batch), generator=g)  # a reward per sample
        token_rewards = torch.zeros(mask.shape)
        last = mask.cumsum(1).argmax(1)
        token_rewards[torch.arange(len(batch)), last] = scores
        batch.tensors["advantages"], _ = compute_advantages(
            "grpo", token_rewards, mask, group_ids=torch.arange(len(batch)) // a.n
        )
        batch.tensors["loss_mask"] = mask
        batch.tensors["old_log_probs"] = batch["rollout_log_probs"]  # one update per batch: old = rollout's
        t_update = time.perf_counter()
        out = engine.forward_backward(batch, loss_fn)
        engine.optimizer_step()
        sync(a.device)
        end = time.perf_counter()
        dt = end - t
        m = mask.bool()
        mismatch.append(float((out.outputs["log_probs"][m] - batch["rollout_log_probs"][m]).abs().mean()))
        if step:
            times.append(dt)
            phases["sync_weights_s"].append(t_synced - t)
            phases["generate_s"].append(t_generated - t_synced)
            phases["update_s"].append(end - t_update)
        else:
            record(f"grpo_geartrain{tag}_first_step_s", round(dt, 2))
    record(
        f"grpo_geartrain{tag}",
        {
            "step_s": round(sorted(times)[len(times) // 2], 3),
            # where the step goes (medians; the rest: advantages on the host)
            **{k: round(sorted(v)[len(v) // 2], 3) for k, v in phases.items() if v},
            "steps": len(times),
            "prompts": a.grpo_prompts,
            "n": a.n,
            "prompt_tokens": a.prompt_tokens,
            "response_tokens": tokens,
            "decode_graph": a.grpo_decode_graph,
            "compiled_layers": a.grpo_compile == "on",
            "mean_abs_logp_mismatch_per_step": [round(x, 5) for x in mismatch],
        },
    )
    ro.shutdown()
    del engine


def grpo_trl(a: argparse.Namespace) -> None:
    try:
        import trl
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except Exception as exc:  # noqa: BLE001
        record("grpo_trl_skipped", f"trl does not import here: {exc!r}"[:300])
        return
    from geartrain.config import ModelConfig
    from geartrain.modeling import build_hf_model, load_tokenizer
    from transformers import TrainerCallback

    mc = ModelConfig(tiny="qwen2") if a.dry_run else ModelConfig(preset="qwen2.5-0.5b")
    model = build_hf_model(mc)
    tok = load_tokenizer(mc)
    rng = random.Random(0)
    alphabet = "0123456789+-*= abcdefghijklmnopqrstuvwxyz"
    count = a.grpo_prompts * (2 + a.steps)
    texts = ["".join(rng.choice(alphabet) for _ in range(a.prompt_tokens)) for _ in range(count)]
    data = Dataset.from_list([{"prompt": t} for t in texts])
    times: list[float] = []
    clock: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN003, ANN201
            sync(a.device)
            clock["t"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003, ANN201
            sync(a.device)
            times.append(time.perf_counter() - clock["t"])

    per_device = a.n * max(1, a.grpo_prompts // 8)
    args = GRPOConfig(
        output_dir="/tmp/trl_issue20",
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=a.grpo_prompts * a.n // per_device,
        num_generations=a.n,
        max_completion_length=a.response_tokens,
        temperature=1.0,
        beta=0.0,
        loss_type="dapo",
        learning_rate=1e-6,
        max_steps=1 + a.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=a.device != "cuda",
        bf16=a.device == "cuda",
        shuffle_dataset=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        generation_kwargs={"min_new_tokens": a.response_tokens},
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **_: [rng.random() for _ in completions]],
        args=args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Clock()],
    )
    trainer.train()
    record(
        "grpo_trl",
        {
            "version": trl.__version__,
            "step_s": round(sorted(times[1:])[len(times[1:]) // 2], 3),
            "first_step_s": round(times[0], 2),
            "steps": len(times) - 1,
        },
    )
    if "grpo_geartrain" in RESULTS:
        record("grpo_geartrain_over_trl", round(RESULTS["grpo_geartrain"]["step_s"] / RESULTS["grpo_trl"]["step_s"], 3))


# --------------------------------------------------------------------------- 6. memory
def memory(a: argparse.Namespace) -> None:
    model = "tiny" if a.dry_run else "qwen2.5-0.5b"
    shape = [
        "--rows",
        str(a.grpo_prompts * a.n),
        "--samples",
        str(a.n),
        "--prompt-tokens",
        str(a.prompt_tokens),
        "--response-tokens",
        str(a.response_tokens),
        "--micro-batch-tokens",
        str(a.micro_tokens),
    ]
    cmd = [sys.executable, "-m", "geartrain.cli", "bench", "memory", model, "--device", a.device, *shape]
    left = max(30, a.budget - (time.perf_counter() - START))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
    print(proc.stdout[-3000:], proc.stderr[-2000:] if proc.returncode else "", flush=True)
    record("memory_phases", proc.stdout.strip().splitlines()[-4:] if proc.returncode == 0 else f"rc={proc.returncode}")
    from geartrain.bench_memory import largest_trainable

    candidates = ["tiny"] if a.dry_run else ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama3-8b"]
    small = dict(rows=8, samples=8, prompt_tokens=256, response_tokens=256, micro_batch_tokens=4096)
    for offload in (False, True):
        for ckpt in (False, True):
            left = a.budget - (time.perf_counter() - START)
            if left < 20:
                record(f"largest_offload{offload}_ckpt{ckpt}", "skipped: time budget spent")
                continue
            best, outcomes = largest_trainable(
                candidates, device=a.device, cpu_offload=offload, gradient_checkpointing=ckpt, timeout=left, **small
            )
            record(f"largest_offload{offload}_ckpt{ckpt}", {"largest": best, "tries": outcomes})


# --------------------------------------------------------------------------- isolation
def run_child(a: argparse.Namespace, label: str, section_key: str, **overrides: Any) -> bool:
    """Run ``section_key`` in a child process of its own (``--isolate``): a CUDA error that
    poisons the context, a hang in a graph capture or an out-of-memory kill then costs that
    section only. The child gets the parent's arguments (with ``overrides``) and the budget
    left; it is killed, with its process group (inductor's compile workers), when that runs
    out. Its figures are merged into :data:`RESULTS` as they were written, also after a crash.
    Returns whether the child ended cleanly without a ``<section>_error``."""
    left = a.budget - (time.perf_counter() - START)
    if left <= 0:
        record(f"{label}_skipped", "time budget spent")
        return False
    fd, path = tempfile.mkstemp(prefix=f"issue20-{label}-", suffix=".json")
    os.close(fd)
    os.unlink(path)  # the child creates it with its first figure
    spec = {**vars(a), **overrides, "budget": left, "sections": [section_key], "isolate": False}
    spec_path = path + ".spec"
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = [sys.executable, os.path.abspath(__file__), "--child-spec", spec_path, "--child-results", path]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        rc: int | str = proc.wait(timeout=left + a.child_grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = f"killed after {time.perf_counter() - t0:.0f} s (the budget left was {left:.0f} s): a hang?"
    child: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path) as f:
            child = json.load(f)
        os.unlink(path)
    os.unlink(spec_path)
    child.pop("device", None)
    child.pop("total_s", None)
    RESULTS.update(child)
    failed = rc != 0 or any(k.endswith("_error") for k in child)
    if rc != 0:
        record(f"{label}_error", f"child process: {rc if isinstance(rc, str) else f'exit status {rc}'}")
    record(f"{label}_process_s", round(time.perf_counter() - t0, 1))
    return not failed


def run_isolated(a: argparse.Namespace) -> None:
    """The sections, each in its own process (see :func:`run_child`); ``decode`` runs one
    process per graph mode, ``grpo`` one for geartrain and one for TRL. When the ``"step"``
    decode failed, the GRPO step's rollout uses ``"forward"`` instead (recorded)."""
    step_decode_failed = False
    for key in a.sections:
        if key == "decode":
            for graph in a.decode_graphs:
                ok = run_child(a, f"decode_{graph}", "decode", decode_graphs=[graph])
                step_decode_failed |= graph == "step" and not ok
        elif key == "grpo":
            graph = a.grpo_decode_graph
            if graph == "step" and step_decode_failed:
                graph = "forward"
                why = "the 'step' decode failed above: the GRPO step decodes with 'forward'"
                record("grpo_decode_graph_fallback", why)
            run_child(a, "grpo_geartrain", "grpo_geartrain", grpo_decode_graph=graph)
            run_child(a, "grpo_trl", "grpo_trl")
            ours, trl = RESULTS.get("grpo_geartrain"), RESULTS.get("grpo_trl")
            if isinstance(ours, dict) and isinstance(trl, dict):
                record("grpo_geartrain_over_trl", round(ours["step_s"] / trl["step_s"], 3))
        else:
            run_child(a, key, key)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dry-run", action="store_true", help="tiny model and shapes (the CPU check of this script)")
    ap.add_argument("--budget", type=float, default=500.0, help="seconds; later sections are skipped after it")
    ap.add_argument(
        "--sections", nargs="+", default=["attention", "mfu05", "decode", "mfu15", "grpo", "grpo1024", "memory"]
    )
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument(
        "--compile",
        nargs="+",
        default=["off", "on"],
        choices=["off", "on"],
        help="update MFU variants: eager decoder layers and/or options.compile (default both)",
    )
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend of --compile on")
    ap.add_argument(
        "--grpo-compile",
        default="off",
        choices=["off", "on"],
        help="the GRPO step's engine with options.compile (once the MFU section shows it pays)",
    )
    ap.add_argument(
        "--decode-graphs",
        nargs="+",
        default=["step", "forward"],
        choices=["step", "forward", "none", "dynamic"],
        help="decode variants: rollout.options.decode_graph of the static path, or the dynamic loop",
    )
    ap.add_argument("--decode-batches", nargs="+", type=int, help="decode batch sizes (default 64 256; 4 8 dry)")
    ap.add_argument("--grpo-decode-graph", default="step", choices=["step", "forward", "none"])
    ap.add_argument("--profile-decode", action="store_true", help="print the top ops of one decode call per variant")
    ap.add_argument(
        "--profile-update", action="store_true", help="print the top ops of one update step per MFU variant"
    )
    ap.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each section in a process of its own, killed when the budget runs out (default: on CUDA)",
    )
    ap.add_argument(
        "--child-grace", type=float, default=30.0, help="seconds an isolated section may run past the budget left"
    )
    ap.add_argument("--fault", choices=["crash", "hang"], help="the script's own test: every child section fails so")
    ap.add_argument("--child-spec", help=argparse.SUPPRESS)
    ap.add_argument("--child-results", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child_spec:
        return child_main(a.child_spec, a.child_results)
    big = not a.dry_run
    a.steps = 3 if big else 1
    a.seq_min, a.seq_max = (1024, 2048) if big else (16, 32)
    a.attn_seqs = 16 if big else 8
    a.mfu_rows = 24 if big else 6
    a.prompt_tokens, a.response_tokens = (256, 256) if big else (8, 8)
    a.decode_batches = a.decode_batches or ([64, 256] if big else [4, 8])
    a.grpo_prompts, a.n = (64, 8) if big else (4, 4)
    a.micro_tokens = 16384 if big else 256
    a.isolate = a.device == "cuda" if a.isolate is None else a.isolate
    name, peak, bw = card(a.device)
    record("device", {"name": name, "bf16_peak_flops": peak, "hbm_bytes_per_s": bw, "torch": torch.__version__})
    if a.isolate:
        run_isolated(a)
    else:
        run_sections(a)
    record("total_s", round(time.perf_counter() - START, 1))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "issue20.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    return 0


def child_main(spec_path: str, results_path: str) -> int:
    """A child of :func:`run_child`: the parent's arguments from ``spec_path``, its
    figures to ``results_path`` as they come."""
    global CHILD_RESULTS
    CHILD_RESULTS = results_path
    with open(spec_path) as f:
        a = argparse.Namespace(**json.load(f))
    if a.fault == "crash":
        record(f"{a.sections[0]}_before_fault", 1)  # a figure from before the crash must still arrive
        os._exit(134)  # as a CUDA error that aborts the process would
    if a.fault == "hang":
        time.sleep(10**6)
    run_sections(a)
    return 0


def run_sections(a: argparse.Namespace) -> None:
    """``a.sections`` one after another in this process."""
    big = not a.dry_run
    sections = {
        "attention": lambda: attention(a),
        "mfu05": lambda: update_mfu(a, "qwen2.5-0.5b", a.micro_tokens),
        "decode": lambda: decode(a),
        "mfu15": lambda: update_mfu(a, "qwen2.5-1.5b", a.micro_tokens // 2),
        "grpo": lambda: (grpo_geartrain(a), grpo_trl(a)),
        "grpo_geartrain": lambda: grpo_geartrain(a),
        "grpo_trl": lambda: grpo_trl(a),
        "grpo1024": lambda: grpo_geartrain(a, response_tokens=1024 if big else 16),
        "memory": lambda: memory(a),
    }
    for key in a.sections:
        section(key, a.budget, sections[key])


if __name__ == "__main__":
    sys.exit(main())
