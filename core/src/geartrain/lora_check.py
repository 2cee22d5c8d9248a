"""What a LoRA configuration does to a model, found before anything runs: whether
``lora.target_modules`` names layers PEFT can adapt, and whether ``lora.rank`` is larger
than any adapted layer can use. ``geartrain check`` and ``geartrain train`` ask it on the
model built on the meta device (no memory, no weights), so ``check`` refuses what the
engine would refuse, in the same words.

PEFT is the engines' library, not the core's: without it installed the check is skipped
(the engine that adapts the model then needs it and says so)."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from geartrain.config import LoraConfig

#: Module classes PEFT's LoRA adapts among those a transformers model holds.
_ADAPTABLE = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass
class LoraFindings:
    """Problems (a run cannot start: ``(config key, message)``) and notes (it can, but
    most likely not as meant)."""

    problems: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _output_layer_name(module: nn.Module) -> str | None:
    """The name of ``module``'s output embedding layer (``lm_head``), if it has one."""
    get = getattr(module, "get_output_embeddings", None)
    out = get() if callable(get) else None
    return next((name for name, m in module.named_modules() if m is out), None) if out is not None else None


def linear_names(module: nn.Module) -> list[str]:
    """The distinct last name parts of ``module``'s linear layers (``q_proj``, ``down_proj``...),
    as ``target_modules`` names them, in model order; not the output layer (no adapter there
    is used: :func:`check_lora`)."""
    seen: dict[str, None] = {}
    output = _output_layer_name(module)
    for name, layer in module.named_modules():
        if isinstance(layer, nn.Linear) and name and name != output:
            seen.setdefault(name.rsplit(".", 1)[-1], None)
    return list(seen)


def target_problem(layers: list[str], target_modules: Any, exc: BaseException) -> str:
    """One line for PEFT's refusal of ``target_modules`` (its messages span lines and print
    whole modules), naming the model's linear ``layers`` (:func:`linear_names`, taken before
    the wrapping: PEFT leaves a model it refused half wrapped)."""
    layers_text = ", ".join(layers) or "none"
    text = " ".join(str(exc).split())
    unsupported = re.match(r"Target module (\w+)\(", text)
    if unsupported:
        return (
            f"{target_modules} matches a {unsupported.group(1)} module, which LoRA cannot adapt (it adapts linear, "
            f"embedding and convolution layers); the model's linear layers are: {layers_text}"
        )
    if "not found in the base model" in text or "No modules were targeted" in text:
        return f"{target_modules} matches no layer of the model; its linear layers are: {layers_text}"
    return f"{target_modules}: {text[:300]}"


def check_lora(module: nn.Module, lora: LoraConfig) -> LoraFindings:
    """Inject ``lora``'s adapters into ``module`` (a model on the meta device, changed in
    place: build a fresh one for anything else) as the engines do, and report what PEFT
    refuses and a rank larger than every adapted layer's smaller side."""
    findings = LoraFindings()
    if importlib.util.find_spec("peft") is None:
        return findings
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer

    peft_config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=lora.target_modules, bias="none")
    layers = linear_names(module)
    try:
        with torch.device("meta"):
            wrapped = get_peft_model(module, peft_config)
    except ValueError as exc:  # PEFT's refusals of the targets are ValueErrors (NoMatchingPeftModuleError is one)
        findings.problems.append(("lora.target_modules", target_problem(layers, lora.target_modules, exc)))
        return findings
    output = _output_layer_name(module)
    on_output = [
        name
        for name, layer in wrapped.named_modules()
        if isinstance(layer, LoraLayer) and output and (name == output or name.endswith("." + output))
    ]
    if on_output:
        # engines compute log-probs from the output layer's weight directly (chunked): an
        # adapter on it is never used, and a run adapting only it had no gradient at step 1
        findings.problems.append(
            (
                "lora.target_modules",
                f"'{output}' is the output layer: log-probs are computed from its weight directly, so an adapter "
                "there would never be used; target the attention and MLP projections (e.g. all-linear)",
            )
        )
        return findings
    widths = [
        min(layer.in_features, layer.out_features)
        for layer in wrapped.modules()
        if isinstance(layer, LoraLayer) and isinstance(layer.get_base_layer(), _ADAPTABLE)
    ]
    if widths and lora.rank > max(widths):
        findings.notes.append(
            f"lora.rank={lora.rank} is larger than the smaller side of every adapted layer (at most {max(widths)}): "
            "a rank past it adds no capacity (the update B A already has full rank there) but costs time and memory "
            "in proportion; ranks of 8 to 64 are usual"
        )
    return findings
