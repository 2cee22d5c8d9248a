"""LoRA adapters on PEFT: wrapping the model before sharding, turning the adapters off (the
reference policy), the base's fingerprint, and the adapter tensors as PEFT names them.

The adapters are injected in place (``peft.get_peft_model``): the transformers model keeps
its class and its ``base_model``, each adapted ``nn.Linear`` becomes a PEFT
``lora.Linear`` holding the frozen ``base_layer`` and the trainable ``lora_A``/``lora_B``.
So the engine's forward path (:class:`~geartrain_fsdp.modeling.TokenOutputs`) is unchanged,
and FSDP shards the adapters with the decoder layer they live in.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from geartrain.config import LoraConfig, ModelConfig
from geartrain.lora_check import linear_names, target_problem
from torch import nn

#: The adapter's name inside PEFT (one adapter per engine).
ADAPTER = "default"
#: Prefix PEFT puts before the transformers module path in adapter files.
PEFT_PREFIX = "base_model.model."


def wrap(hf: nn.Module, config: LoraConfig) -> Any:
    """Inject the adapters into ``hf`` in place (base weights frozen, adapters fp32 whatever
    the base's dtype) and return the ``PeftModel`` around it (kept for its config)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    init: bool | str = True if config.init == "default" else config.init
    peft_config = PeftLoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=config.target_modules,
        init_lora_weights=init,
        bias="none",
    )
    layers = linear_names(hf)  # before PEFT: a refused wrapping leaves the model half wrapped
    try:
        peft_model = get_peft_model(hf, peft_config, adapter_name=ADAPTER, autocast_adapter_dtype=True)
    except ValueError as exc:  # e.g. target_modules matching nothing: in check's words
        from geartrain.errors import ConfigError

        raise ConfigError([("lora.target_modules", target_problem(layers, config.target_modules, exc))]) from None
    return peft_model


def adapter_config(peft_model: Any, base: str | None) -> dict[str, Any]:
    """The PEFT ``adapter_config.json`` of the engine's adapter, as a JSON-ready dict."""
    cfg = peft_model.peft_config[ADAPTER]
    data = cfg.to_dict()
    data["base_model_name_or_path"] = base
    return json.loads(json.dumps(data, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def lora_layers(module: nn.Module) -> list[nn.Module]:
    """Every PEFT LoRA layer inside ``module``."""
    from peft.tuners.lora import LoraLayer

    return [m for m in module.modules() if isinstance(m, LoraLayer)]


@contextlib.contextmanager
def adapters_disabled(module: nn.Module) -> Iterator[None]:
    """Run ``module`` as its base model: every LoRA layer's adapter off, restored after."""
    layers = lora_layers(module)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


@dataclass(frozen=True, slots=True)
class Site:
    """One adapted linear layer: its transformers module path and its tensors (possibly
    sharded), with the scale of its update ``W + scale x B A``."""

    module: str
    base_weight: torch.Tensor
    base_bias: torch.Tensor | None
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scale: float


def sites(hf: nn.Module) -> dict[str, Site]:
    """The adapted layers of ``hf`` by transformers module path."""
    from peft.tuners.lora import LoraLayer

    out: dict[str, Site] = {}
    for name, layer in hf.named_modules():
        if isinstance(layer, LoraLayer) and ADAPTER in layer.lora_A:
            base = layer.get_base_layer()
            out[name] = Site(
                module=name,
                base_weight=base.weight,
                base_bias=getattr(base, "bias", None),
                lora_a=layer.lora_A[ADAPTER].weight,
                lora_b=layer.lora_B[ADAPTER].weight,
                scale=float(layer.scaling[ADAPTER]),
            )
    return out


def transformers_name(state_name: str) -> str | None:
    """The transformers checkpoint name of a state-dict entry of the wrapped model, or None
    for an adapter tensor (``...q_proj.base_layer.weight`` -> ``...q_proj.weight``)."""
    if ".lora_" in state_name:
        return None
    return state_name.replace(".base_layer.", ".")


def merged_weight(site: Site, full: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``W + scale x B A`` in fp32 (``full`` gathers a sharded tensor)."""
    w = full(site.base_weight.detach()).float()
    a = full(site.lora_a.detach()).float()
    b = full(site.lora_b.detach()).float()
    return torch.addmm(w, b, a, alpha=site.scale)


def adapter_names(module: str) -> tuple[str, str]:
    """The PEFT adapter-file names of a layer's A and B."""
    return f"{PEFT_PREFIX}{module}.lora_A.weight", f"{PEFT_PREFIX}{module}.lora_B.weight"


def base_fingerprint(hf: nn.Module) -> str:
    """SHA-256 over the frozen base weights (names as transformers saves them, dtype, shape
    and bytes), for the checkpoint to refuse a resume onto another base. Needs the full
    (unsharded, non-meta) tensors: taken before sharding."""
    digest = hashlib.sha256()
    for name, tensor in sorted(hf.state_dict().items()):
        plain = transformers_name(name)
        if plain is None:
            continue
        t = tensor.detach().contiguous().cpu()
        digest.update(f"{plain}|{t.dtype}|{tuple(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def base_reference(model: ModelConfig) -> str:
    """How a checkpoint names the base: its path, or the tiny family, seed and overrides."""
    if model.path is not None:
        return model.path
    kind = f"preset:{model.preset}" if getattr(model, "preset", None) else f"tiny:{model.tiny}"
    return f"{kind}:seed={model.seed}:{json.dumps(model.config_overrides, sort_keys=True)}"
