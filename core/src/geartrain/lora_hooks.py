"""Serving a PEFT LoRA adapter on a plain transformers model without touching its weights:
forward hooks on the adapted linear layers. The reference torch rollout's ``update_adapter``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from geartrain.errors import GeartrainError

#: Prefix of the module paths in a PEFT adapter file.
PEFT_PREFIX = "base_model.model."


def adapter_scale(config: dict[str, Any]) -> float:
    """``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``), from a PEFT adapter config."""
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise GeartrainError("update_adapter: per-module rank_pattern / alpha_pattern adapters are not supported")
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def split_adapter(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module path: (A [r, in], B [out, r])}`` from tensors named as in a PEFT adapter file."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        stem, _, kind = name.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight") or not stem:
            raise GeartrainError(
                f"update_adapter: '{name}' is not a LoRA tensor name of a PEFT adapter file "
                f"('{PEFT_PREFIX}<module>.lora_A.weight' / '.lora_B.weight')"
            )
        parts.setdefault(stem, {})[kind[0]] = tensor
    out = {}
    for module, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise GeartrainError(f"update_adapter: module '{module}' has lora_{''.join(ab)} but not both A and B")
        out[module] = (ab["A"], ab["B"])
    return out


@dataclass
class LoraHooks:
    """An adapter attached to a model's linear layers; :meth:`remove` detaches it."""

    name: str
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    handles: list[Any] = field(default_factory=list)

    @classmethod
    def attach(
        cls,
        model: nn.Module,
        tensors: dict[str, torch.Tensor],
        config: dict[str, Any],
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_rank: int | None = None,
        name: str = "default",
    ) -> LoraHooks:
        scale = adapter_scale(config)
        rank = int(config["r"])
        if max_rank is not None and rank > max_rank:
            raise GeartrainError(f"update_adapter: rank {rank} exceeds the rollout's max_lora_rank ({max_rank})")
        weights = {}
        for module, (a, b) in split_adapter(tensors).items():
            try:
                layer = model.get_submodule(module)
            except AttributeError:
                raise GeartrainError(f"update_adapter: the model has no module '{module}'") from None
            if not isinstance(layer, nn.Linear):
                raise GeartrainError(f"update_adapter: '{module}' is a {type(layer).__name__}, not a linear layer")
            if tuple(a.shape) != (rank, layer.in_features) or tuple(b.shape) != (layer.out_features, rank):
                raise GeartrainError(
                    f"update_adapter: '{module}' needs A [{rank}, {layer.in_features}] "
                    f"and B [{layer.out_features}, {rank}], got {tuple(a.shape)} and {tuple(b.shape)}"
                )
            weights[module] = (a.detach().to(device, dtype, copy=True), b.detach().to(device, dtype, copy=True))
        hooks = cls(name=name, scale=scale, weights=weights)
        for module, (a, b) in weights.items():
            hooks.handles.append(model.get_submodule(module).register_forward_hook(_lora_hook(a, b, scale)))
        return hooks

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _lora_hook(a: torch.Tensor, b: torch.Tensor, scale: float) -> Any:
    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        x = inputs[0].to(a.dtype)
        return output + nn.functional.linear(nn.functional.linear(x, a), b) * scale

    return hook
