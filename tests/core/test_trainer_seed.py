"""``trainer.seed`` seeds everything random unless a section sets its own seed (issue 19,
item 7): the model's initialisation, the data order, the SFT order."""

from __future__ import annotations

import torch
from geartrain.data import PromptDataset, PromptLoader
from geartrain.modeling import build_hf_model, tiny_tokenizer
from geartrain.trainer import load_train_config

ROWS = [{"prompt": f"{i}+1=", "ground_truth": str(i + 1)} for i in range(32)]


def _job(*overrides: str):  # noqa: ANN202
    return load_train_config(
        None, ["model.tiny=qwen2", "data.apply_chat_template=false", *overrides], check_plugins=False
    )


def _weights(config) -> torch.Tensor:  # noqa: ANN001
    return torch.cat([p.detach().flatten() for p in build_hf_model(config.model).parameters()])


def _order(config) -> list[int]:  # noqa: ANN001
    dataset = PromptDataset(ROWS, tiny_tokenizer(), config.data)
    return PromptLoader.from_config(dataset).order(0)


def test_trainer_seed_seeds_the_model_the_data_order_and_sft() -> None:
    seven, eight = _job("trainer.seed=7"), _job("trainer.seed=8")
    assert (seven.model.seed, seven.data.seed, seven.sft.seed) == (7, 7, 7)
    assert not torch.equal(_weights(seven), _weights(eight))
    assert _order(seven) != _order(eight)
    # the same trainer.seed gives the same model and order
    assert torch.equal(_weights(seven), _weights(_job("trainer.seed=7")))
    assert _order(seven) == _order(_job("trainer.seed=7"))


def test_a_sections_own_seed_wins() -> None:
    own = _job("trainer.seed=7", "model.seed=3", "data.seed=5", "sft.seed=9")
    assert (own.model.seed, own.data.seed, own.sft.seed) == (3, 5, 9)
    assert torch.equal(_weights(own), _weights(_job("trainer.seed=3")))
    assert _order(own) == _order(_job("trainer.seed=5"))
