"""Tiny Hugging Face models and a character tokenizer, built in code (no downloads).

Used by the conformance suites, the tests and the CPU main job. The same ``(family, seed,
overrides)`` always gives the same weights, in any process.
"""

from __future__ import annotations

import string
from typing import Any, Literal

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerFast

Family = Literal["qwen2", "llama"]

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
#: Printable ASCII after the four special tokens; ids are stable across versions.
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII, with ``<pad>`` (0), ``<s>`` (1),
    ``</s>`` (2), ``<unk>`` (3) and a plain ``role: content`` chat template."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK] + CHARACTERS)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK, padding_side="left"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_config(family: Family = "qwen2", **overrides: Any) -> PretrainedConfig:
    """A transformers config of a tiny ``family`` model sized for the tiny tokenizer."""
    if family not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny family {family!r}; choose from {sorted(TINY_CONFIGS)}")
    fields = dict(TINY_CONFIGS[family])
    fields.update(vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    fields.update(overrides)
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, **fields)


def tiny_model(family: Family = "qwen2", seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A randomly initialised tiny causal LM (fp32, eval mode), the same for the same
    arguments in any process."""
    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.eval()
