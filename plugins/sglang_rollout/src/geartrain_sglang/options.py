"""The ``[rollout.options]`` section of the SGLang backend (returned by ``config_schema``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: ``sglang.Engine`` arguments geartrain sets from a setting of its own: given in
#: ``engine_kwargs`` they would silently disagree with it (the prompt-length checks measure
#: against ``rollout.max_model_len``).
OWNED_ENGINE_KWARGS: dict[str, str] = {
    "model_path": "model.path",
    "context_length": "rollout.max_model_len",
    "dtype": "rollout.dtype",
    "max_running_requests": "rollout.max_num_seqs",
    "tp_size": "rollout.tensor_parallel_size",
    "random_seed": "rollout.options.seed",
    "mem_fraction_static": "rollout.gpu_memory_utilization",
    "trust_remote_code": "model.trust_remote_code",
    "attention_backend": "rollout.options.attention_backend",
    "max_total_tokens": "rollout.options.max_total_tokens",
    "log_level": "rollout.options.log_level",
    "skip_tokenizer_init": "nothing: geartrain passes token ids and needs it on",
}


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
    """Extra keyword arguments for ``sglang.Engine`` (those geartrain sets from a setting of its own
    are refused, naming the setting: :data:`OWNED_ENGINE_KWARGS`)."""

    @field_validator("engine_kwargs")
    @classmethod
    def _not_owned(cls, value: dict[str, Any]) -> dict[str, Any]:
        owned = [f"{key} (set {OWNED_ENGINE_KWARGS[key]})" for key in value if key in OWNED_ENGINE_KWARGS]
        if owned:
            raise ValueError(f"geartrain sets these itself from its own settings: {'; '.join(owned)}")
        return value
