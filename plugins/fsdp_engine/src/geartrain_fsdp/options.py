"""The FSDP engine's own options section (``[actor.engine.options]``)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field


class FSDPOptions(BaseModel):
    """Options of the ``fsdp`` engine backend; validated by the core via ``config_schema``."""

    model_config = ConfigDict(extra="forbid")

    reshard_after_forward: bool = True
    """FSDP2: free each layer's gathered parameters after its forward (less memory, one
    more all-gather in backward)."""
    remove_padding: bool = True
    """Pack each micro-batch's sequences into one row (position_ids restart per sequence,
    no attention across sequence boundaries). ``False`` runs padded ``[b, T]`` micro-batches
    (needs ``parallel.sp == 1``)."""
    share_prompt_prefix: bool = True
    """With ``remove_padding`` and ``sp = 1``: rows of a micro-batch with the same prompt
    (a GRPO group's samples) run that prompt once, each response attending to it under a
    segment mask (:mod:`geartrain_fsdp.prefix_sharing`). Same outputs and gradients up to
    float rounding; for ``n`` samples of a prompt of ``p`` tokens, ``(n - 1) p`` fewer
    tokens through every layer. Micro-batches keep each prompt's rows together."""
    logits_chunk_tokens: int = Field(1024, ge=1)
    """Tokens per chunk of the vocabulary projection: log-probs and entropy never
    materialise more than ``chunk x vocab`` logits (recomputed in backward)."""
    fused_log_probs: bool = True
    """Train through the log-prob / entropy head with its own closed-form backward
    (:class:`geartrain_fsdp.logprobs.LinearLogProbs`: each chunk's logits recomputed once,
    one ``chunk x vocab`` fp32 buffer at a time) instead of autograd through checkpointed
    chunks. With ``compile`` its per-chunk functions are compiled too."""
    meta_init: bool = False
    """Build the model on the meta device on ranks > 0 and broadcast rank 0's weights
    while sharding (large models: one full copy in host memory instead of one per rank)."""
    hsdp_replicate: int = Field(1, ge=1)
    """Hybrid sharding: replicate over this many groups, shard inside each group. 1 = FSDP
    over all ranks."""
    cpu_offload: bool = False
    """FSDP2 ``CPUOffloadPolicy``: sharded parameters, gradients and optimizer state live in
    host memory (pinned on GPU machines)."""
    attention: Literal["auto", "sdpa", "flex", "flash"] = "auto"
    """Kernel of the packed and shared-prompt attention (``remove_padding``): ``auto`` is
    flash-attn's varlen kernels on CUDA when flash-attn is installed
    (``pip install './plugins/fsdp_engine[flash-attn]'``), else compiled flex_attention under
    a block mask on CUDA, else SDPA per sequence / per segment bucket (CPU). flex_attention
    has no CPU backward in torch 2.13: on CPU ``flex`` serves forward-only roles.
    :mod:`geartrain_fsdp.attention_kernels`."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduce-scatter under mixed precision (``param_dtype``)."""
    compile: bool | None = None
    """Regional compilation (default: on for CUDA, off elsewhere; :meth:`compiles`):
    ``torch.compile`` each decoder layer's forward (dynamic token counts; the packed
    attention stays eager between two compiled graphs per layer). Fuses
    the elementwise work around the matmuls, which dominates small hidden sizes on GPU.
    Composes with FSDP2, gradient checkpointing, LoRA and sequence parallel.
    :mod:`geartrain_fsdp.compiling`."""
    compile_backend: str = "inductor"
    """``torch.compile`` backend of ``compile`` (``aot_eager``: same graphs, no code
    generation; for tests)."""

    def compiles(self, device: torch.device) -> bool:
        """Whether ``compile`` is on for an engine on ``device``: as set, else on CUDA only
        (the GPU run measured the uncompiled step's elementwise work as a large share of
        it; a CPU compiles slowly and gains little)."""
        return self.compile if self.compile is not None else device.type == "cuda"
