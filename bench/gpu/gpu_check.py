"""GPU-only paths of the FSDP engine + torch rollout, checked against references on CUDA.

Run on a machine with one CUDA GPU: size-1 NCCL group from the core, FSDP2 fp32 log-probs vs
plain transformers on the same GPU, a training step vs AdamW, bf16 mixed precision (close to
fp32), offload/onload (GPU memory freed, training identical), cpu_offload policy with pinned
memory, torch rollout on CUDA after a weight sync (rollout log-probs == engine log-probs)."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from geartrain.cluster.process_group import acquire_single_rank_group, release_single_rank_group
from geartrain.config import EngineConfig, ModelConfig, OptimConfig
from geartrain.engine import Engine
from geartrain.modeling import build_hf_model
from geartrain.testing.reference import (
    make_batch,
    reference_logits,
    reference_token_outputs,
    token_mean_nll_loss,
    token_outputs_from_logits,
    token_valid_mask,
)
from geartrain.types import EngineContext

results: dict[str, object] = {}

DEV = os.environ.get("GT_DEVICE", "cuda")
CUDA = DEV == "cuda"


def record(name: str, value: object, ok: bool | None = None) -> None:
    results[name] = value if ok is None else {"value": value, "ok": ok}
    print(f"{name}: {value}" + ("" if ok is None else f"  [{'OK' if ok else 'FAIL'}]"), flush=True)


def engine(group, *, options=None, lr=1e-3, **fields) -> Engine:
    cfg = EngineConfig(
        backend="fsdp", options=options or {}, optim=OptimConfig(lr=lr, weight_decay=0.01, clip_grad=1.0), **fields
    )
    return Engine(
        cfg, ModelConfig(tiny="qwen2", seed=3), EngineContext(role="actor", seed=0, device=DEV, process_group=group)
    )


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def allocated() -> int:
    return torch.cuda.memory_allocated() if CUDA else 0


def on_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().cpu()


def main() -> int:
    record("gpu", torch.cuda.get_device_name(0) if CUDA else "cpu")
    record("torch", torch.__version__)
    group = acquire_single_rank_group(DEV)
    import torch.distributed as dist

    record("process_group_backend", dist.get_backend(group), dist.get_backend(group) == ("nccl" if CUDA else "gloo"))
    batch = make_batch([5, 3, 7, 4], [6, 9, 2, 5], seed=0)
    mask = token_valid_mask(batch["attention_mask"])

    # fp32 forward vs plain transformers on the same GPU
    eng = engine(group)
    out = eng.compute_log_probs(batch, entropy=True)
    hf = build_hf_model(ModelConfig(tiny="qwen2", seed=3))  # the reference stays on the CPU
    ref = reference_token_outputs(hf, batch)
    err = float((on_cpu(out.outputs["log_probs"]) - ref["log_probs"]).abs()[mask].max())
    record("fp32_logprob_max_err_vs_hf_cpu", err, err < 1e-4)

    # one training step vs AdamW on the CPU copy
    eng.forward_backward(batch, token_mean_nll_loss)
    stats = eng.optimizer_step()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3, weight_decay=0.01)
    lp = token_outputs_from_logits(reference_logits(hf, batch), batch["input_ids"], batch["attention_mask"])[
        "log_probs"
    ]
    lm = batch["loss_mask"].float()
    loss = -(lp * lm).sum() / lm.sum()
    loss.backward()
    gn = float(torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0))
    opt.step()
    record("step_grad_norm_engine_vs_hf", [stats["grad_norm"], gn], abs(stats["grad_norm"] - gn) < 1e-3 * max(1, gn))
    after = eng.compute_log_probs(batch).outputs["log_probs"]
    ref_after = reference_token_outputs(hf, batch)["log_probs"]
    err = float((on_cpu(after) - ref_after).abs()[mask].max())
    record("after_step_logprob_max_err_vs_hf_cpu", err, err < 5e-4)

    # offload / onload frees GPU memory and keeps training identical
    sync()
    before = allocated()
    mem = eng.offload()
    sync()
    freed = before - allocated()
    record("offload_stats", str(mem))
    record("offload_freed_bytes", freed, freed > 0 if CUDA else None)
    eng.onload()
    again = eng.compute_log_probs(batch).outputs["log_probs"]
    record(
        "onload_identical",
        bool(torch.equal(on_cpu(again), on_cpu(after))),
        bool(torch.equal(on_cpu(again), on_cpu(after))),
    )

    # torch rollout on CUDA after a weight sync: its log-probs of its samples == engine's
    try:
        from geartrain.config import RolloutConfig
        from geartrain.rollout import Rollout
        from geartrain.types import SamplingParams

        ro = Rollout(
            RolloutConfig(backend="torch"),
            ModelConfig(tiny="qwen2", seed=3),
            EngineContext(role="rollout", seed=0, device=DEV, process_group=group),
        )
        t0 = time.perf_counter()
        sync_stats = eng.sync_weights(ro)
        record("weight_sync_s", time.perf_counter() - t0)
        record("weight_sync_stats", str(sync_stats))
        prompts = [batch["input_ids"][i][batch["attention_mask"][i].bool()][:4].tolist() for i in range(4)]
        gen = ro.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=1))
        gen = gen[0] if isinstance(gen, tuple) else gen
        lp_engine = eng.compute_log_probs(gen).outputs["log_probs"]
        rm = gen["response_mask"].bool()
        err = float((on_cpu(lp_engine) - on_cpu(gen["rollout_log_probs"])).abs()[rm].max())
        record("rollout_vs_engine_logprob_max_err", err, err < 1e-4)
    except Exception as exc:  # report and go on: the remaining checks are independent
        record("rollout_check_error", repr(exc), False)

    # bf16 mixed precision: close to fp32
    try:
        eng16 = engine(group, param_dtype="bfloat16")
        lp16 = eng16.compute_log_probs(batch).outputs["log_probs"]
        fresh = engine(group).compute_log_probs(batch).outputs["log_probs"]
        err = float((on_cpu(lp16) - on_cpu(fresh)).abs()[mask].max())
        record("bf16_vs_fp32_logprob_max_err", err, err < 0.1)
        t0 = time.perf_counter()
        for _ in range(5):
            eng16.forward_backward(batch, token_mean_nll_loss)
            s = eng16.optimizer_step()
        sync()
        record("bf16_5_steps_s", time.perf_counter() - t0)
        record("bf16_last_grad_norm_finite", s["grad_norm"], bool(torch.isfinite(torch.tensor(s["grad_norm"]))))
    except Exception as exc:
        record("bf16_error", repr(exc), False)

    # shared-prompt packing (a GRPO batch: each prompt n times) under CUDA's SDPA with a mask:
    # equal to plain packing, fp32 and bf16, and how much faster
    try:
        from geartrain.layout import sequence_batch

        g = torch.Generator().manual_seed(0)
        prompts, responses = [], []
        for _ in range(16):
            prompt = torch.randint(4, 120, (int(torch.randint(20, 60, (1,), generator=g)),), generator=g).tolist()
            for _ in range(8):
                prompts.append(prompt)
                responses.append(
                    torch.randint(4, 120, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
                )
        gb = sequence_batch(prompts, responses, 0, mask_key="loss_mask")
        for dtype in ("float32", "bfloat16"):
            shared, plain = (
                engine(group, param_dtype=dtype),
                engine(group, param_dtype=dtype, options={"share_prompt_prefix": False}),
            )
            oa = shared.forward_backward(gb, token_mean_nll_loss)
            ga = shared.optimizer_step()["grad_norm"]
            ob = plain.forward_backward(gb, token_mean_nll_loss)
            gb_norm = plain.optimizer_step()["grad_norm"]
            lm = gb["loss_mask"].bool()
            err = float((on_cpu(oa.outputs["log_probs"]) - on_cpu(ob.outputs["log_probs"])).abs()[lm].max())
            tol = 1e-4 if dtype == "float32" else 0.1
            record(f"shared_prompts_{dtype}_logprob_max_err_vs_plain", err, err < tol)
            record(
                f"shared_prompts_{dtype}_grad_norm_vs_plain",
                [ga, gb_norm],
                abs(ga - gb_norm) < (1e-3 if dtype == "float32" else 0.05) * max(1.0, gb_norm),
            )
            clocks = {}
            for name, e in (("shared", shared), ("plain", plain)):
                for _ in range(2):
                    e.forward_backward(gb, token_mean_nll_loss)
                    e.optimizer_step()
                sync()
                t0 = time.perf_counter()
                for _ in range(10):
                    e.forward_backward(gb, token_mean_nll_loss)
                    e.optimizer_step()
                sync()
                clocks[name] = (time.perf_counter() - t0) / 10
            record(
                f"shared_prompts_{dtype}_step_s_shared_vs_plain",
                [round(clocks["shared"], 4), round(clocks["plain"], 4)],
            )
    except Exception as exc:
        record("shared_prompts_error", repr(exc), False)

    # FSDP2 CPUOffloadPolicy with pinned memory on a GPU machine
    try:
        engc = engine(group, options={"cpu_offload": True})
        engc.forward_backward(batch, token_mean_nll_loss)
        sc = engc.optimizer_step()
        record(
            "cpu_offload_policy_grad_norm_vs_plain",
            [sc["grad_norm"], stats["grad_norm"]],
            abs(sc["grad_norm"] - stats["grad_norm"]) < 1e-3,
        )
    except Exception as exc:
        record("cpu_offload_error", repr(exc), False)

    release_single_rank_group(group)
    bad = [k for k, v in results.items() if isinstance(v, dict) and not v["ok"]]
    record("failed_checks", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    code = main()
    import os

    out = os.environ.get("OUT")
    if out:
        with open(f"{out}/gpu_check.json", "w") as f:
            json.dump(results, f, indent=1, default=str)
    sys.exit(code)
