"""What a TRL user tripped on (issue 34, items 1-8), each checked on the main job."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import MAIN_CONFIG
from geartrain.data.config import DataConfig
from geartrain.errors import ConfigError
from geartrain.trainer import load_train_config, run_job
from geartrain.trainer.config import TrainConfig, TrainerConfig


def _config(tmp_path: Path, *overrides: str) -> TrainConfig:
    """The main job for 2 steps without SFT, validation or exports."""
    return load_train_config(
        MAIN_CONFIG,
        [
            "sft.enabled=false",
            "trainer.progress=false",
            "trainer.export_hf=false",
            "trainer.plot=false",
            "trainer.tensorboard=false",
            "trainer.total_steps=2",
            "validation.every_n_steps=0",
            "validation.max_prompts=4",
            "trainer.log_completions=4",
            *overrides,
            f"trainer.output_dir={tmp_path / 'run'}",
        ],
        check_plugins=False,
    )


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def exact(response: str, ground_truth: str) -> float:
    return float(response.strip() == ground_truth.strip())


def brevity(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return [-float(len(c)) for c in completions]


def test_run_job_takes_a_list_of_weighted_reward_functions(tmp_path: Path) -> None:
    """Item 4: ``run_job(reward_fn=[f, g], reward_weights=[...])`` as TRL's ``reward_funcs``
    and ``reward_weights`` (it raised TypeError: unhashable type: 'list'); each function is
    logged under its name and the reward is the weighted sum."""
    config = _config(tmp_path)
    run_job(config, reward_fn=[exact, brevity], reward_weights=[1.0, 0.1])
    records = [r for r in _rows(tmp_path / "run" / "completions.jsonl") if r["kind"] == "train"]
    assert records
    for r in records:
        assert set(r["rewards"]) == {"exact", "brevity"}
        assert r["rewards"]["brevity"] == -len(r["response"])
        assert r["reward"] == pytest.approx(r["rewards"]["exact"] + 0.1 * r["rewards"]["brevity"])
    metrics = [m for m in _rows(tmp_path / "run" / "metrics.jsonl") if m["step"] >= 1]
    assert all("reward/exact/mean" in m and "reward/brevity/mean" in m for m in metrics)
    with pytest.raises(ConfigError, match="reward_weights: 1 weights for 2 reward functions"):
        run_job(_config(tmp_path / "b"), reward_fn=[exact, brevity], reward_weights=[1.0])


def test_python_constructors_answer_trl_names_and_answer_key() -> None:
    """Item 4: a section built in Python gets the hints a job file gets (it raised pydantic's
    "Extra inputs are not permitted"), and ``answer_key`` is ``ground_truth_key``'s other
    name in Python too (the docs' name was refused on assignment)."""
    with pytest.raises(ValueError, match="max_steps: unknown key 'max_steps'; TRL's 'max_steps' is trainer.total_st"):
        TrainerConfig(max_steps=3)
    with pytest.raises(ConfigError) as info:
        TrainConfig(trainer={"total_step": 3}, sampling={"num_generations": 4})
    problems = dict(info.value.problems)
    assert problems["trainer.total_step"] == "unknown key 'total_step'; did you mean 'total_steps'?"
    assert "sampling.n" in problems["sampling.num_generations"]
    assert "Extra inputs" not in str(info.value)
    config = TrainConfig()
    config.data.answer_key = "answer"
    assert config.data.ground_truth_key == "answer" == config.data.answer_key
    assert DataConfig(answer_key="label").ground_truth_key == "label"


def test_a_lora_export_loads_with_auto_peft_and_names_its_base_portably(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 3: the adapter's ``task_type`` is ``CAUSAL_LM`` (it was null, so
    ``AutoPeftModelForCausalLM`` failed) and its base is named relative to the export (the
    run's warm start, ``../sft_model``), not as an absolute path of the training machine."""
    from peft import AutoPeftModelForCausalLM, PeftModel

    config = load_train_config(
        MAIN_CONFIG.parent / "grpo_lora.toml",
        [
            "sft.steps=2",
            "sft.min_steps=0",
            "sft.eval_every=100",
            "trainer.progress=false",
            "trainer.plot=false",
            "trainer.tensorboard=false",
            "trainer.total_steps=1",
            "validation.every_n_steps=0",
            "validation.max_prompts=4",
            f"trainer.output_dir={tmp_path / 'run'}",
        ],
        check_plugins=False,
    )
    run_job(config)
    export = tmp_path / "run" / "hf"
    adapter = json.loads((export / "adapter_config.json").read_text())
    assert adapter["task_type"] == "CAUSAL_LM"
    assert adapter["base_model_name_or_path"] == "../sft_model"
    monkeypatch.chdir(export)  # the base is named relative to the export directory
    model = AutoPeftModelForCausalLM.from_pretrained(".")
    assert isinstance(model, PeftModel) and model.peft_config["default"].r == config.actor.lora.rank


def test_portable_base_names(tmp_path: Path) -> None:
    """Item 3: a hub id stays, a Hugging Face cache snapshot is its hub id, another directory
    is relative to the export."""
    from geartrain.export import portable_base

    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "run" / "hf").mkdir(parents=True)
    assert portable_base(str(snapshot), tmp_path / "run" / "hf") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert portable_base("Qwen/Qwen2.5-0.5B", tmp_path) == "Qwen/Qwen2.5-0.5B"
    assert portable_base(str(tmp_path / "models" / "mine"), tmp_path) == str(tmp_path / "models" / "mine")  # absent
    (tmp_path / "models" / "mine").mkdir(parents=True)
    assert portable_base(str(tmp_path / "models" / "mine"), tmp_path / "run" / "hf") == "../../models/mine"
