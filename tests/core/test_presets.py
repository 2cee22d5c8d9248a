"""``model.preset``: released architectures built in code (no download)."""

from __future__ import annotations

import pytest
import torch
from geartrain.config import ModelConfig
from geartrain.modeling import build_hf_model, load_tokenizer, tiny_tokenizer
from geartrain.presets import PRESETS, PUBLISHED_PARAMETERS


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_count_matches_the_published_size(name: str) -> None:
    model = build_hf_model(ModelConfig(preset=name), meta=True)  # shapes only: no memory
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMETERS[name]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_tokenizer_has_the_real_vocabulary_and_reads_text_like_the_tiny_one(name: str) -> None:
    tok = load_tokenizer(ModelConfig(preset=name))
    vocab = PRESETS[name]["vocab_size"]
    assert len(tok) == vocab
    text = "12+345=357"
    assert tok(text)["input_ids"] == tiny_tokenizer()(text)["input_ids"]
    last = tok.decode([vocab - 1])
    assert last == f"<|gt{vocab - 1}|>"
    assert tok(last)["input_ids"] != [vocab - 1]  # text never encodes to a filler token


def test_preset_model_runs_with_random_weights_from_its_seed() -> None:
    # a shrunk qwen2.5-0.5b (1 layer): same vocabulary and widths, small enough for CPU
    config = ModelConfig(preset="qwen2.5-0.5b", seed=5, config_overrides={"num_hidden_layers": 1})
    a, b = build_hf_model(config), build_hf_model(config)
    assert a.config.vocab_size == 151936 and a.config.hidden_size == 896
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        la, lb = a(input_ids=ids).logits, b(input_ids=ids).logits
    assert la.shape == (1, 4, 151936)
    assert torch.equal(la, lb)


def test_exactly_one_model_source() -> None:
    with pytest.raises(ValueError, match="exactly one of 'path'.*'preset'"):
        ModelConfig(tiny="qwen2", preset="qwen2.5-0.5b")
    with pytest.raises(ValueError, match="preset"):
        ModelConfig(preset="qwen2.5-3b")
