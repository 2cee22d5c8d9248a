"""``geartrain check`` finds what the engine's PEFT wrapping would refuse, in the engine's
own words, and says when a LoRA rank is larger than any adapted layer can use (probes3's
9c and 9d, issue 35): before, check passed a ``target_modules`` that matches no layer,
which train refused only after an --overwrite had set the previous run aside, and a rank
of 100000 on a 128-wide model ran about 100x slower without a word."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from geartrain.cli import main
from geartrain.config import EngineConfig, LoraConfig, ModelConfig
from geartrain.engine import Engine
from geartrain.errors import ConfigError
from geartrain.lora_check import check_lora
from geartrain.modeling import build_hf_model

from .common import rank_context

ROOT = Path(__file__).resolve().parents[2]
LORA_JOB = ROOT / "examples" / "arithmetic" / "grpo_lora.toml"
MODEL = ModelConfig(tiny="qwen2", seed=3)
LAYERS = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"


def engine_refusal(lora: LoraConfig) -> str:
    """What the fsdp engine says when it wraps the model with ``lora``."""
    with pytest.raises(ConfigError) as info:
        Engine(EngineConfig(backend="fsdp", lora=lora), MODEL, rank_context(0, 1))
    (problem,) = info.value.problems
    assert problem[0] == "actor.engine.lora.target_modules"
    return problem[1]


@pytest.mark.parametrize(
    ("targets", "said"),
    [
        (["nonexistent"], f"['nonexistent'] matches no layer of the model; its linear layers are: {LAYERS}"),
        (
            ["q_proj", "mlp"],
            "['q_proj', 'mlp'] matches a Qwen2MLP module, which LoRA cannot adapt (it adapts linear, embedding "
            f"and convolution layers); the model's linear layers are: {LAYERS}",
        ),
    ],
)
def test_check_refuses_what_the_engine_refuses_in_its_words(targets: list[str], said: str) -> None:
    lora = LoraConfig(rank=8, target_modules=targets)
    findings = check_lora(build_hf_model(MODEL, meta=True), lora)
    assert findings.problems == [("lora.target_modules", said)]
    assert engine_refusal(lora) == said


@pytest.mark.parametrize(("rank", "noted"), [(8, False), (64, False), (65, True), (100000, True)])
def test_a_rank_above_every_adapted_layers_smaller_side_is_noted(rank: int, noted: bool) -> None:
    """The tiny qwen2's adapted layers are at most 64 on their smaller side (hidden 64)."""
    findings = check_lora(build_hf_model(MODEL, meta=True), LoraConfig(rank=rank))
    assert findings.problems == []
    assert findings.notes == (
        [
            f"lora.rank={rank} is larger than the smaller side of every adapted layer (at most 64): a rank past it "
            "adds no capacity (the update B A already has full rank there) but costs time and memory in "
            "proportion; ranks of 8 to 64 are usual"
        ]
        if noted
        else []
    )


def _previous_run(out: Path) -> dict[str, bytes]:
    out.mkdir()
    (out / "config.json").write_text('{"trainer": {}, "actor": {}}')
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    return {p.name: p.read_bytes() for p in out.iterdir()}


@pytest.mark.parametrize("command", ["check", "train"])
def test_a_target_matching_nothing_is_refused_before_the_previous_run_is_set_aside(
    tmp_path: Path, capsys: Any, command: str
) -> None:
    out = tmp_path / "run"
    before = _previous_run(out)
    rc = main(
        [
            command,
            str(LORA_JOB),
            "--overwrite",
            f"trainer.output_dir={out}",
            'actor.lora.target_modules=["nonexistent"]',
            "sft.enabled=false",
            "trainer.progress=false",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "lora.target_modules: ['nonexistent'] matches no layer of the model" in err, err
    assert "Traceback" not in err and "set aside" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_check_prints_the_rank_note(tmp_path: Path, capsys: Any) -> None:
    rc = main(["check", str(LORA_JOB), f"trainer.output_dir={tmp_path / 'run'}", "actor.lora.rank=100000"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "note: lora.rank=100000 is larger than the smaller side of every adapted layer" in out


@pytest.mark.parametrize("targets", [["lm_head"], ["q_proj", "lm_head"]])
def test_an_adapter_on_the_output_layer_is_refused(targets: list[str]) -> None:
    """Issue 35, round 14: ``target_modules = ["lm_head"]`` (listed then among the linear
    layers a refusal suggested) passed ``check``; training failed at step 1 ("element 0 of
    tensors does not require grad"): log-probs come from the output layer's weight directly,
    so its adapter was never used."""
    findings = check_lora(build_hf_model(MODEL, meta=True), LoraConfig(rank=8, target_modules=targets))
    assert findings.problems == [
        (
            "lora.target_modules",
            "'lm_head' is the output layer: log-probs are computed from its weight directly, so an adapter there "
            "would never be used; target the attention and MLP projections (e.g. all-linear)",
        )
    ]
