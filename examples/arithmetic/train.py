"""The main job composed in Python: the same pipeline as

    geartrain train examples/arithmetic/grpo.toml

built from config sections in code instead of a file, with the reward as a plain Python
function. Extra ``key.path=value`` arguments override fields, as on the command line:

    python examples/arithmetic/train.py trainer.output_dir=outputs/api trainer.seed=1
"""

from __future__ import annotations

import sys
from pathlib import Path

from geartrain import EngineConfig, ModelConfig, OptimConfig, RolloutConfig
from geartrain.config import apply_overrides, validate_config
from geartrain.data import DataConfig
from geartrain.trainer import TrainConfig, run_job
from geartrain.trainer.config import (
    ActorConfig,
    AlgorithmConfig,
    SamplingConfig,
    SFTConfig,
    TrainerConfig,
    ValidationConfig,
)
from geartrain.validation import check_backends

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from task import exact_match  # noqa: E402  (the task's reward, next to this file)


def build_config(overrides: list[str]) -> TrainConfig:
    config = TrainConfig(
        model=ModelConfig(
            tiny="qwen2",
            config_overrides=dict(
                hidden_size=128,
                intermediate_size=256,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
            ),
        ),
        sft=SFTConfig(
            enabled=True,
            path=str(HERE / "data/train.jsonl"),
            steps=1000,
            batch_size=64,
            optim=OptimConfig(lr=1e-3, weight_decay=0.1),
            dev_path=str(HERE / "data/sft_dev.jsonl"),
            eval_every=20,
            min_steps=100,
            stop_at_accuracy=0.3,
        ),
        algorithm=AlgorithmConfig(name="grpo"),
        actor=ActorConfig(
            engine=EngineConfig(
                backend="fsdp",
                optim=OptimConfig(lr=3e-4, weight_decay=0.0, lr_schedule="cosine", warmup_steps=50, min_lr_ratio=0.1),
            )
        ),
        rollout=RolloutConfig(backend="torch", max_model_len=32),
        sampling=SamplingConfig(n=8, temperature=1.0, max_tokens=5),
        data=DataConfig(
            path=str(HERE / "data/train.jsonl"), batch_size=16, apply_chat_template=False, max_prompt_length=16
        ),
        validation=ValidationConfig(path=str(HERE / "data/val.jsonl"), every_n_steps=50),
        trainer=TrainerConfig(
            total_steps=1200, output_dir="outputs/arithmetic_grpo_api", save_every=50, torch_threads=1
        ),
    )
    if overrides:  # round-trip through the validator so overrides are checked like a file's
        data = apply_overrides(config.model_dump(exclude_unset=True), overrides)
        config = check_backends(validate_config(TrainConfig, data))
    return config


if __name__ == "__main__":
    result = run_job(build_config(sys.argv[1:]), reward_fn=exact_match)
    gain = 100 * ((result.accuracy_after or 0) - (result.accuracy_before or 0))
    print(f"gain: {gain:.1f} points in {result.seconds:.0f}s")
