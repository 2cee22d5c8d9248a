"""The Hugging Face directory SGLang loads: the user's ``path``, or one written for a tiny model."""

from __future__ import annotations

from pathlib import Path

from geartrain.config import ModelConfig
from geartrain.modeling import build_hf_model, hf_config, load_tokenizer


def model_directory(config: ModelConfig, work_dir: Path) -> Path:
    """A directory with ``config.json`` and weights for ``config``.

    A ``path`` without ``config_overrides`` is used as is (a local directory, or a hub id
    SGLang resolves). A tiny model, or a ``path`` with ``config_overrides`` (which SGLang
    could not apply), is built with :func:`geartrain.modeling.build_hf_model` and written,
    with its tokenizer, under ``work_dir/model``.
    """
    if config.path is not None and not config.config_overrides:
        return Path(config.path) if Path(config.path).exists() else Path(str(config.path))
    target = work_dir / "model"
    target.mkdir(parents=True, exist_ok=True)
    model = build_hf_model(config)
    model.save_pretrained(target, safe_serialization=True)
    load_tokenizer(config).save_pretrained(target)
    # SGLang adds a generation config's EOS ids to the ones that stop a sample
    (target / "generation_config.json").unlink(missing_ok=True)
    del model
    return target


def pad_token_id(config: ModelConfig, override: int | None) -> int:
    """The id used for padding in returned batches."""
    if override is not None:
        return override
    pad = getattr(hf_config(config), "pad_token_id", None)
    return int(pad) if pad is not None else 0
