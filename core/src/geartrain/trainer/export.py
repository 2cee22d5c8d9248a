"""``geartrain export CHECKPOINT DIR``: any checkpoint of a run as a complete Hugging Face
directory (the one a finished run writes to ``<output_dir>/hf``)."""

from __future__ import annotations

import json
from pathlib import Path

from geartrain.checkpoint import CheckpointManager
from geartrain.config import ModelConfig
from geartrain.errors import CheckpointError
from geartrain.export import ModelCard, base_model_name, finish_adapter_export, finish_hf_export


def run_of(checkpoint: Path) -> tuple[Path, Path]:
    """``(checkpoint, run directory)`` for a checkpoint directory
    (``<run>/checkpoints/actor/step_N``) or a run directory (its newest intact checkpoint)."""
    if (checkpoint / "checkpoints" / "actor").is_dir():
        latest = CheckpointManager(checkpoint / "checkpoints" / "actor").latest_intact(lambda _: None)
        if latest is None:
            raise CheckpointError(f"{checkpoint} holds no complete checkpoint to export")
        return latest, checkpoint
    CheckpointManager.check_complete(checkpoint)
    run = checkpoint.resolve().parents[2]
    if not (run / "config.json").is_file():
        raise CheckpointError(
            f"{checkpoint}: no config.json in its run directory {run}; give a checkpoint inside a run "
            "(<output_dir>/checkpoints/actor/step_N)"
        )
    return checkpoint, run


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Load ``checkpoint`` into the run's actor engine and write it to ``out_dir`` as a
    complete Hugging Face directory (weights, config with ``architectures``,
    ``generation_config.json``, the tokenizer, a model card). Returns ``out_dir``."""
    from geartrain.engine import Engine
    from geartrain.modeling import load_tokenizer
    from geartrain.trainer.config import TrainConfig
    from geartrain.types import EngineContext

    checkpoint, run = run_of(Path(checkpoint))
    config = TrainConfig.model_validate(json.loads((run / "config.json").read_text(encoding="utf-8")))
    policy = config.model
    sft_dir = run / "sft_model"
    if config.sft.enabled and (sft_dir / "config.json").is_file():  # RL started from the warm start
        policy = ModelConfig(
            path=str(sft_dir.resolve()), dtype=policy.dtype, attn_implementation=policy.attn_implementation
        )
    tokenizer = load_tokenizer(config.model)
    engine = Engine(config.actor.engine, policy, EngineContext(role="actor", seed=config.trainer.seed))
    extra = engine.load_checkpoint(checkpoint)
    out = engine.export_hf(Path(out_dir), tokenizer)
    if (out / "adapter_config.json").is_file():
        finish_adapter_export(out)
    if (out / "config.json").is_file():  # a LoRA export is an adapter directory
        step = int(extra.get("step", CheckpointManager.step_of(checkpoint)))
        card = ModelCard(
            base_model=base_model_name(config.model),
            algorithm=config.algorithm.name.upper(),
            steps=step,
            source=str(checkpoint),
        )
        finish_hf_export(out, card, tokenizer)
    return out
