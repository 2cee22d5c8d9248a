"""Real model architectures without downloads: ``model.preset``.

Each preset is the published ``config.json`` of a released model, written here field by
field (the architecture: sizes, heads, vocabulary, rope, norm epsilon, tied embeddings), so
that throughput and memory are measured on the true shapes. The weights are random (from
``model.seed``), and the tokenizer is built in code too (:func:`preset_tokenizer`): the
character tokenizer of the tiny models, padded with filler tokens to the model's real
vocabulary size, so that any token id the model samples decodes and any text the tiny
models read (the arithmetic job) tokenizes the same way. Special token ids therefore are
the character tokenizer's (pad 0, bos 1, eos 2), not the released tokenizer's.

Published parameter counts (embedding included, tied once): qwen2.5-0.5b 494,032,768;
qwen2.5-1.5b 1,543,714,304; qwen2.5-7b 7,615,616,512; llama3-8b 8,030,261,248.
"""

from __future__ import annotations

from typing import Any, Literal

from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerFast

from geartrain.char_tokenizer import char_tokenizer

__all__ = ["PRESETS", "PUBLISHED_PARAMETERS", "Preset", "preset_config", "preset_tokenizer"]

Preset = Literal["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama3-8b"]

_QWEN25 = dict(
    model_type="qwen2",
    hidden_act="silu",
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    use_sliding_window=False,
    sliding_window=32768,
    attention_dropout=0.0,
    initializer_range=0.02,
)

#: The architecture fields of each released model's config.json (Qwen/Qwen2.5-*,
#: meta-llama/Meta-Llama-3-8B), verbatim.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(
        _QWEN25,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_window_layers=24,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        _QWEN25,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_window_layers=28,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        _QWEN25,
        max_position_embeddings=131072,
        sliding_window=131072,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_window_layers=28,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "llama3-8b": dict(
        model_type="llama",
        hidden_act="silu",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        vocab_size=128256,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
    ),
}

#: Parameter counts of the released checkpoints (what the model card / safetensors index says).
PUBLISHED_PARAMETERS: dict[str, int] = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
    "llama3-8b": 8_030_261_248,
}


def preset_config(name: str, **overrides: Any) -> PretrainedConfig:
    """The transformers config of preset ``name`` (``overrides`` applied last), with the
    special token ids of :func:`preset_tokenizer`."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
    fields = dict(PRESETS[name])
    fields.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    fields.update(overrides)
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, **fields)


def preset_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """The character tokenizer (:func:`geartrain.modeling.tiny_tokenizer`'s ids and chat
    template) extended with filler tokens ``<|gtN|>`` up to preset ``name``'s vocabulary
    size: ``len(tokenizer) == vocab_size`` and every id decodes."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
    return char_tokenizer(PRESETS[name]["vocab_size"])
