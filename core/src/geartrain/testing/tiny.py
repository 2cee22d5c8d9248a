"""The tiny models and character tokenizer, re-exported for tests: they live in
:mod:`geartrain.modeling` (production code builds them for ``model.tiny``)."""

from geartrain.modeling import (
    BOS,
    CHARACTERS,
    CHAT_TEMPLATE,
    EOS,
    PAD,
    TINY_CONFIGS,
    UNK,
    Family,
    tiny_config,
    tiny_model,
    tiny_tokenizer,
)

__all__ = [
    "BOS",
    "CHARACTERS",
    "CHAT_TEMPLATE",
    "EOS",
    "PAD",
    "TINY_CONFIGS",
    "UNK",
    "Family",
    "tiny_config",
    "tiny_model",
    "tiny_tokenizer",
]
