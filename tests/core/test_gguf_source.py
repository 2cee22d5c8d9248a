"""GGUF weights as a model source (issue 32 item 1), on tiny Llama models written in the test
with the gguf package's own writer (no download): the dequantized directory holds exactly
the written weights and the file's tokenizer, is made once under a lock and reused, and a
missing ``gguf``, an architecture transformers cannot read, and a damaged file each get one
clear error."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from geartrain.config import ModelConfig
from geartrain.errors import GeartrainError
from geartrain.gguf_source import RECORD, find_gguf, hf_path
from geartrain.modeling import build_hf_model, load_tokenizer, model_directory
from transformers import AutoConfig, AutoModelForCausalLM

pytest.importorskip("gguf", reason="the core suite's environment installs core[gguf]")
from geartrain.testing.gguf_writer import write_llama_gguf  # noqa: E402


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GEARTRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _tiny(tied: bool = True, seed: int = 0) -> torch.nn.Module:
    cfg = AutoConfig.for_model(
        "llama",
        vocab_size=272,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("tied", [True, False])
def test_a_gguf_file_loads_as_the_model_it_was_written_from(tmp_path: Path, cache: Path, tied: bool) -> None:
    source = _tiny(tied)
    gguf = write_llama_gguf(source, tmp_path / "tiny.gguf")
    config = ModelConfig(path=str(gguf))
    built = build_hf_model(config).eval()
    ids = torch.tensor([[5, 40, 90, 260, 17, 3, 200]])
    with torch.no_grad():
        assert torch.equal(built(ids).logits, source(ids).logits)  # F32 in, F32 out: bit for bit
    tokenizer = load_tokenizer(config)
    text = "the sum: 12+30=42\n  two spaces"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    messages = [{"role": "user", "content": "hi"}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"

    directory = Path(hf_path(str(gguf)))
    assert directory.parent == cache / "gguf" and model_directory(config, tmp_path / "work") == directory
    record = json.loads((directory / RECORD).read_text())
    assert record["sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert record["source"] == str(gguf) and record["architecture"] == "llama"
    hf = json.loads((directory / "config.json").read_text())
    assert "quantization_config" not in hf and hf["architectures"] == ["LlamaForCausalLM"]
    assert hf["tie_word_embeddings"] is tied


def test_a_directory_or_an_installed_package_that_ships_one_gguf_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = write_llama_gguf(_tiny(), tmp_path / "pkgroot" / "tiny_gguf_models" / "model.gguf")
    (gguf.parent / "__init__.py").write_text("raise RuntimeError('a model package is never imported')\n")
    assert find_gguf(gguf.parent) == gguf.resolve()
    monkeypatch.syspath_prepend(str(tmp_path / "pkgroot"))
    assert find_gguf("tiny_gguf_models") == gguf.resolve()
    assert find_gguf("tiny-gguf-models") == gguf.resolve()  # the distribution's spelling
    assert find_gguf("Qwen/Qwen2.5-0.5B") is None and find_gguf("no_such_package_here") is None
    write_llama_gguf(_tiny(seed=1), gguf.parent / "other.gguf")
    with pytest.raises(GeartrainError, match=r"holds 2 GGUF files \(model.gguf, other.gguf\): name one of them"):
        find_gguf(gguf.parent)


def test_two_processes_dequantize_once(tmp_path: Path, cache: Path) -> None:
    gguf = write_llama_gguf(_tiny(), tmp_path / "tiny.gguf")
    code = "import sys; from geartrain.gguf_source import hf_path; print(hf_path(sys.argv[1]))"
    env = {**__import__("os").environ, "GEARTRAIN_CACHE": str(cache)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(gguf)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert len({out.strip() for out, _ in outs}) == 1
    assert sum(err.count("dequantizing") for _, err in outs) == 1, outs
    assert sorted(p.name for p in (cache / "gguf").iterdir() if not p.name.endswith(".lock")) == [
        Path(outs[0][0].strip()).name
    ]


def test_a_damaged_file_is_named_and_nothing_is_cached(tmp_path: Path, cache: Path) -> None:
    gguf = write_llama_gguf(_tiny(), tmp_path / "tiny.gguf")
    data = gguf.read_bytes()
    gguf.write_bytes(data[: len(data) // 2])  # cut off mid-tensor
    with pytest.raises(GeartrainError, match=r"tiny.gguf (is not a readable GGUF file|could not be dequantized)"):
        hf_path(str(gguf))
    assert not any(p.is_dir() for p in (cache / "gguf").iterdir())
    gguf.write_bytes(b"not a model at all")
    with pytest.raises(GeartrainError, match="is not a GGUF file"):
        hf_path(str(gguf))
    with pytest.raises(GeartrainError, match="no such GGUF file"):
        hf_path(str(tmp_path / "missing.gguf"))


def test_an_architecture_transformers_cannot_read_is_named(tmp_path: Path) -> None:
    import gguf as gguf_package

    path = tmp_path / "odd.gguf"
    writer = gguf_package.GGUFWriter(str(path), "frobnicator")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GeartrainError, match=r"holds a 'frobnicator' model, which transformers .* cannot dequantize"):
        hf_path(str(path))


def test_without_the_gguf_package_the_extra_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = write_llama_gguf(_tiny(), tmp_path / "tiny.gguf")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(GeartrainError, match=r"needs the gguf package: pip install 'geartrain\[gguf\]'"):
        hf_path(str(gguf))


def test_an_adapter_exported_from_a_gguf_model_names_a_base_peft_can_load(tmp_path: Path, cache: Path) -> None:
    """A LoRA export's ``base_model_name_or_path`` is the dequantized directory, not the GGUF
    file or package name (which PEFT cannot read)."""
    from geartrain.export import finish_adapter_export

    gguf = write_llama_gguf(_tiny(), tmp_path / "tiny.gguf")
    export = tmp_path / "adapter"
    export.mkdir()
    (export / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(gguf), "r": 4}))
    finish_adapter_export(export)
    base = json.loads((export / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == hf_path(str(gguf)) and Path(base).is_absolute()
    assert AutoConfig.from_pretrained(base).model_type == "llama"


def test_a_damaged_cache_entry_is_made_again(tmp_path: Path, cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 35, round 13: a dequantized copy whose model.safetensors was cut short (its
    record intact) passed ``check`` and failed the engine's build in a 53-line traceback."""
    gguf = write_llama_gguf(_tiny(), tmp_path / "tiny.gguf")
    first = Path(hf_path(str(gguf)))
    weights = first / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:100])
    again = Path(hf_path(str(gguf)))
    assert again == first and weights.read_bytes() == whole
    assert "the dequantized copy is damaged, so it is made again" in caplog.text


def test_a_cache_that_cannot_be_written_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 35, round 13: GEARTRAIN_CACHE naming a file was reported as the tokenizer of the
    GGUF failing to load ("Not a directory"), never naming GEARTRAIN_CACHE."""
    gguf = write_llama_gguf(_tiny(), tmp_path / "tiny.gguf")
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("GEARTRAIN_CACHE", str(tmp_path / "afile"))
    with pytest.raises(GeartrainError) as info:
        hf_path(str(gguf))
    assert str(info.value) == (
        f"model.path {gguf}: the cache of dequantized models, {tmp_path / 'afile' / 'gguf'}, cannot be written "
        "(Not a directory); set GEARTRAIN_CACHE to a writable directory"
    )
