"""Regional compilation (``options.compile``): ``torch.compile`` each decoder layer's
``forward``, so the memory-bound elementwise work around the matmuls (RMSNorm in fp32,
rotary, SiLU * mul, residual adds, autocast casts) runs as fused kernels.

Only ``forward`` is compiled, in place: the module tree, parameter names and state dict
stay those of the transformers model (checkpoints, weight sync and HF export see no
``_orig_mod`` prefix), and the hooks around ``forward`` stay eager: FSDP2's all-gather /
reshard hooks, and transformers' gradient checkpointing (which wraps the layer's
``__call__``, so backward recomputes the compiled forward). PEFT's LoRA layers are
submodules of the decoder layer and are compiled with it.

The packed attention (:func:`geartrain_fsdp.ulysses.packed_attention`) is opaque to
dynamo (``torch.compiler.disable``): it reads the per-forward attention state and plans
its work from Python lists (sequence lengths, segments), which a graph would specialise
on. Each layer thus compiles as two graphs, before and after attention; the attention
kernels run as they do eagerly (SDPA, flash-attn varlen, or flex_attention, which is
compiled on its own on CUDA), Ulysses' all-to-all included.

Shapes: ``dynamic=True``. The token count of a packed micro-batch changes with every
micro-batch; with dynamo's default (static first, dynamic on the first new shape) each
region compiles twice, and marking dimensions by hand would have to reach the tensors
transformers builds inside the model (hidden states, rotary cos/sin). With
``dynamic=True`` the token dimension is symbolic from the first compile, while the hidden
sizes are specialised anyway through the (static) parameter shapes. Every layer runs the
same code object, so the graphs are compiled once and reused by all layers (dynamo treats
the layer's parameters as inputs).
"""

from __future__ import annotations

import shutil

import torch
from torch import nn

from geartrain_fsdp.modeling import decoder_layers

__all__ = ["RECOMPILE_LIMIT", "check_backend", "compile_decoder_layers"]

RECOMPILE_LIMIT = 32
"""Compiled variants kept per layer code object (dynamo's default: 8)."""


def check_backend(backend: str, device: torch.device) -> str | None:
    """Why ``backend`` cannot compile on ``device`` (a one-line message naming the fix),
    or None when it can."""
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        return f"unknown torch.compile backend {backend!r}; one of {sorted(known)}"
    has_cxx = any(shutil.which(c) for c in ("g++", "c++", "clang++"))
    if backend == "inductor" and device.type == "cpu" and not has_cxx:
        return (
            "the inductor backend on CPU needs a C++ compiler (g++): install one, or set compile_backend = 'aot_eager'"
        )
    return None


def compile_decoder_layers(hf: nn.Module, *, backend: str) -> int:
    """Replace each decoder layer's ``forward`` by its compiled version; returns how many
    layers were compiled. Idempotent: a layer already compiled is left alone."""
    # Each (grad mode, input requires_grad, LoRA adapters on/off, one-token filler
    # micro-batch, ...) combination is a cache entry of the one layer code object that
    # every engine of the process shares (actor, reference, critic); past dynamo's default
    # limit of 8 the layers would silently run eagerly.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    count = 0
    for layer in decoder_layers(hf):
        if getattr(layer, "_geartrain_compiled", False):
            continue
        layer.forward = torch.compile(layer.forward, backend=backend, dynamic=True)
        layer._geartrain_compiled = True
        count += 1
    return count
