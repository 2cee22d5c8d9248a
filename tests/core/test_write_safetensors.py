"""``geartrain.export.write_safetensors``: the weights of an HF export, written once for
every engine, read back by transformers' own loader."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from geartrain.export import write_safetensors
from geartrain.testing.tiny import tiny_model
from transformers import AutoModelForCausalLM


def _model() -> torch.nn.Module:
    return tiny_model("llama", seed=0)  # untied: every tensor under one name


def _roundtrip(tmp_path: Path, shard_bytes: int) -> tuple[torch.nn.Module, torch.nn.Module, Path]:
    model = _model()
    out = tmp_path / "hf"
    model.config.save_pretrained(out)
    write_safetensors(out, model.state_dict().items(), shard_bytes=shard_bytes)
    return model, AutoModelForCausalLM.from_pretrained(out), out


def test_one_file_loads_back_bitwise(tmp_path: Path) -> None:
    model, loaded, out = _roundtrip(tmp_path, 4 << 30)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_shards_and_index_load_back_bitwise(tmp_path: Path) -> None:
    model, loaded, out = _roundtrip(tmp_path, 64 << 10)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    state = model.state_dict()
    assert set(index["weight_map"]) == set(state) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    for name, tensor in state.items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
