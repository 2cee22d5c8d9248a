"""The ``[rollout.options]`` section of the SGLang backend (returned by ``config_schema``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class SglangOptions(BaseModel):
    """SGLang-specific settings. The generic limits (dtype, max length, KV-cache budget,
    tensor-parallel size, max sequences, GPU memory share) live in ``RolloutConfig``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    seed: int = 0
    """Engine seed (``random_seed``); seeded requests use their own per-sample seeds."""
    attention_backend: str | None = None
    """SGLang attention backend; ``None``: ``torch_native`` on CPU, SGLang's choice on GPU."""
    max_total_tokens: int | None = Field(None, ge=16)
    """KV-cache pool size in tokens; ``None``: from ``RolloutConfig.kv_cache_bytes`` on CPU
    (or ``max_num_seqs x max_model_len`` tokens, clamped), SGLang's choice on GPU."""
    weight_sync: Literal["tensor", "distributed"] = "tensor"
    """``tensor``: ``update_weights_from_tensor`` per bucket (the engine's scheduler gets
    the tensors through shared memory); ``distributed``: a process group between this
    process (rank 0) and the engine's workers, ``update_weights_from_distributed`` per
    bucket, tensors broadcast over it (gloo on CPU, NCCL on GPU)."""
    keep_weights_copy: bool | None = None
    """Keep a host copy of the last synced weights, so a released CPU engine (shut down:
    SGLang frees nothing on CPU otherwise) restarts with them. ``None``: on CPU only."""
    spill_weights_to_disk: bool = True
    """On CPU ``release``, write that copy to a safetensors file and drop it from memory."""
    work_dir: str | None = None
    """Where the model directory of a tiny model and spilled weights go; default: a
    temporary directory removed at ``shutdown``."""
    pad_token_id: int | None = None
    """Id written into padding positions; default: the model config's ``pad_token_id``, else 0."""
    cpu_threads: int | None = Field(1, ge=1)
    """On CPU, the intra-op (OpenMP) threads of SGLang's scheduler process, where it
    generates (``OMP_NUM_THREADS`` of its processes, unless set in the environment);
    ``None``: torch's default, one per core. One by default: a team of several threads
    stalls at every op's barrier whenever one of them is descheduled, as on a busy machine
    (``bench/bench_sglang.py --contention`` measures both)."""
    log_level: str = "error"
    """SGLang's log level."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for ``sglang.Engine`` (they override the ones geartrain sets)."""
