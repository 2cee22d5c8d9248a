"""A two-step GRPO job on the real pretrained model (issue 32: SmolLM2-135M-Instruct) for
the rollout-backend tests: natural-language sums under the model's chat template, fp32
on CPU, written into the test's directory. The reward is dense (the right number, minus a
length term) so that every group has a spread and every step moves the weights; the
learning rate is large enough that a weight sync that did not arrive shows as a
trainer-vs-rollout log-prob gap far above the fp32 tolerance."""

from __future__ import annotations

import json
import random
from pathlib import Path

from e2e_helpers import rl_records, run_geartrain

STEPS = 2
#: a hang guard only, below the tests' pytest timeout (3600 s)
JOB_HANG_GUARD_S = 3000
#: trainer (fp32, packed) vs rollout (fp32) log-probs of the rollout's samples, per step
MISMATCH_ATOL = 1e-3

REWARD = """
import re


def score(response: str, ground_truth: str, **_) -> float:
    numbers = re.findall(r"-?\\d+", response)
    right = bool(numbers) and numbers[-1] == ground_truth
    return float(right) - 0.01 * len(response)
"""


def write_job(root: Path, model: str, backend: str, *, lora: bool) -> Path:
    """The job's TOML (and its data and reward beside it) under ``root``; returns the TOML."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    rows = []
    for _ in range(16):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": f"What is {a} + {b}? Answer with the number.", "ground_truth": str(a + b)})
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "reward.py").write_text(REWARD)
    lora_section = (
        '[actor.lora]\nrank = 8\nalpha = 16\ntarget_modules = "all-linear"\nsync = "adapter"\n' if lora else ""
    )
    # LoRA learns with a larger rate (B starts at 0); both are large for a pretrained model
    # on purpose: one step changes its log-probs by far more than MISMATCH_ATOL
    lr = 1e-3 if lora else 1e-4
    rollout_extra = "max_lora_rank = 8\n" if lora else ""
    if backend == "vllm":
        rollout_extra += "kv_cache_bytes = 268435456\n"
    text = f"""
[model]
path = "{model}"

[algorithm]
name = "grpo"
clip_ratio = 0.2
loss_agg_mode = "token-mean"

{lora_section}
[actor.engine]
backend = "fsdp"
optim = {{ lr = {lr}, weight_decay = 0.0, clip_grad = 1.0 }}

[rollout]
backend = "{backend}"
max_model_len = 128
{rollout_extra}
[sampling]
n = 4
temperature = 1.0
max_tokens = 16

[reward]
function = "reward.py:score"

[data]
path = "train.jsonl"
batch_size = 4
apply_chat_template = true
max_prompt_length = 64

[trainer]
total_steps = {STEPS}
output_dir = "{root / "run"}"
save_every = 0
tensorboard = false
export_hf = false
plot = false
progress = false
torch_threads = 2
"""
    path = root / "job.toml"
    path.write_text(text)
    return path


def run_job(root: Path, model: str, backend: str, *, lora: bool) -> list[dict]:
    """Run the job; return its GRPO steps' metric records (the run must succeed)."""
    job = write_job(root, model, backend, lora=lora)
    proc = run_geartrain("train", str(job), timeout=JOB_HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = rl_records(root / "run" / "metrics.jsonl")
    records = [r for r in records if "rollout_mismatch/max_abs_diff" in r]
    assert len(records) == STEPS, records
    return records


def model_bytes(model: str) -> int:
    """fp32 bytes of every distinct weight (a tied embedding once) of ``model``."""
    import torch
    from geartrain.gguf_source import hf_path
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_path(model)))
    return 4 * sum(p.numel() for p in net.parameters())


def check_mismatch(records: list[dict]) -> None:
    gaps = [r["rollout_mismatch/max_abs_diff"] for r in records]
    print(f"\nmax |trainer - rollout| log-prob per step: {gaps}")
    assert max(gaps) <= MISMATCH_ATOL, gaps


def check_full_syncs(records: list[dict], model: str) -> None:
    """Every step's log-probs agree; the step after an update synced every weight."""
    check_mismatch(records)
    assert records[-1]["hybrid/weight_sync_bytes"] == model_bytes(model), records[-1]


def check_lora_syncs(records: list[dict], model: str) -> None:
    """Every step's log-probs agree; the step after an update synced the adapter alone."""
    check_mismatch(records)
    moved = records[-1]["hybrid/weight_sync_bytes"]
    assert 0 < moved < model_bytes(model) / 20, (moved, model_bytes(model))
