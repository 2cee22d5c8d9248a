"""The HF export is complete (issue 19, items 8 and 9): config.json with architectures,
generation_config.json, the tokenizer, a model card, files readable by the group; loaded by
AutoModelForCausalLM, by pipeline("text-generation") and by vLLM's model config; and
``geartrain export`` turns a checkpoint into the same directory."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch
from e2e_helpers import MAIN_CONFIG, run_geartrain

RUN = [
    "sft.enabled=false",
    "trainer.progress=false",
    "trainer.plot=false",
    "trainer.total_steps=2",
    "trainer.save_every=1",
    "validation.every_n_steps=0",
    "validation.max_prompts=8",
    "actor.engine.optim.lr_schedule=constant",
    "actor.engine.optim.warmup_steps=0",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("export")
    # a reward that differs between samples of a random policy, so every step changes the weights
    (root / "r.py").write_text("def shorter(response, ground_truth):\n    return -float(len(response))\n")
    out = root / "run"
    proc = run_geartrain(
        "train", str(MAIN_CONFIG), *RUN, f"reward.function={root / 'r.py'}:shorter", f"trainer.output_dir={out}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_the_export_is_a_complete_readable_model_directory(run: Path) -> None:
    hf = run / "hf"
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == 2
    card = (hf / "README.md").read_text()
    for line in (
        "- algorithm: GRPO",
        "- steps: 2",
        "- geartrain version: 0.1.0",
        "| val/accuracy |",
        "- base model: tiny qwen2 (random weights)",
    ):
        assert line in card, card
    for path in [hf, *hf.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o044 == 0o044, f"{path} is {oct(mode)}: not readable by the group and others"


def test_transformers_and_vllm_load_it(run: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    hf = str(run / "hf")
    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf)
    ids = tokenizer("12+34=", return_tensors="pt", add_special_tokens=False).input_ids
    greedy = model.generate(ids, max_new_tokens=5, do_sample=False)[0, ids.shape[1] :]
    text = pipeline("text-generation", model=hf)("12+34=", max_new_tokens=5, do_sample=False, return_full_text=False)
    assert text[0]["generated_text"] == tokenizer.decode(greedy, skip_special_tokens=True)

    from vllm.config import ModelConfig

    assert ModelConfig(model=hf, tokenizer=hf).architecture == "Qwen2ForCausalLM"


def test_geartrain_export_writes_the_same_model_from_a_checkpoint(run: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "exported"
    proc = run_geartrain("export", str(run / "checkpoints" / "actor" / "step_00000002"), str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    final, again = load_file(str(run / "hf" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert final.keys() == again.keys()
    assert all(torch.equal(final[k], again[k]) for k in final)  # the last checkpoint is the final policy
    assert "exported from: " in (out / "README.md").read_text()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    # step 1 differs from the final policy
    one = tmp_path / "step1"
    assert run_geartrain("export", str(run / "checkpoints" / "actor" / "step_00000001"), str(one)).returncode == 0
    step1 = load_file(str(one / "model.safetensors"))
    assert any(not torch.equal(step1[k], final[k]) for k in final)
    bad = run_geartrain("export", str(tmp_path), str(tmp_path / "x"))
    assert bad.returncode == 2 and "error:" in bad.stderr and "Traceback" not in bad.stderr
