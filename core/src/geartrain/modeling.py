"""Building transformers models and tokenizers from a :class:`~geartrain.config.ModelConfig`.

Backends call these so that every engine and rollout builds *the same* model from the same
config: a tiny random model from its seed, or a checkpoint from a hub id / directory.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PretrainedConfig,
)

from geartrain.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``."""
    return _DTYPES[name]


def hf_config(config: ModelConfig) -> PretrainedConfig:
    """The transformers config the model is built from (overrides applied)."""
    if config.tiny is not None:
        from geartrain.testing.tiny import tiny_config

        hf = tiny_config(config.tiny, **config.config_overrides)
    else:
        hf = AutoConfig.from_pretrained(config.path, trust_remote_code=config.trust_remote_code)
        for key, value in config.config_overrides.items():
            setattr(hf, key, value)
    if config.value_head:
        hf.num_labels = 1
        # Token-classification heads default to dropout 0.1; a value model must be a
        # deterministic function of its weights (train and forward-only agree).
        hf.classifier_dropout = 0.0
    return hf


def build_hf_model(config: ModelConfig, *, device: str | torch.device = "cpu", meta: bool = False) -> torch.nn.Module:
    """Build the causal LM (or, with ``config.value_head``, a token-classification model
    with one label: a per-token value) that ``config`` describes.

    Tiny models are initialised from ``config.seed`` (identical across processes); ``path``
    models load their weights, unless ``meta`` asks for an empty module on the meta device
    (the caller then loads weights itself, e.g. broadcast from rank 0).
    """
    hf = hf_config(config)
    dtype = torch_dtype(config.dtype)
    auto = AutoModelForTokenClassification if config.value_head else AutoModelForCausalLM
    kwargs: dict[str, Any] = dict(attn_implementation=config.attn_implementation, trust_remote_code=config.trust_remote_code)
    if meta:
        with torch.device("meta"):
            model = auto.from_config(hf, dtype=dtype, **kwargs)
        return model
    if config.path is not None:
        model = auto.from_pretrained(config.path, config=hf, dtype=dtype, **kwargs)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            model = auto.from_config(hf, dtype=dtype, **kwargs)
    return model.to(device)


def load_tokenizer(config: ModelConfig) -> Any:
    """The tokenizer for ``config``: ``tokenizer`` or ``path``, or the built-in character
    tokenizer for tiny models."""
    source = config.tokenizer or config.path
    if source is None:
        from geartrain.testing.tiny import tiny_tokenizer

        return tiny_tokenizer()
    return AutoTokenizer.from_pretrained(source, trust_remote_code=config.trust_remote_code)
