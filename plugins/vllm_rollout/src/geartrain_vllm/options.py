"""The ``[rollout.options]`` section of the vLLM backend (returned by ``config_schema``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: ``vllm.LLM`` arguments geartrain sets from a setting of its own: given in ``engine_kwargs``
#: they would silently disagree with it (``max_model_len=8`` cut every response to 2 tokens
#: while the checks measured prompts against ``rollout.max_model_len``).
OWNED_ENGINE_KWARGS: dict[str, str] = {
    "model": "model.path",
    "max_model_len": "rollout.max_model_len",
    "dtype": "rollout.dtype",
    "max_num_seqs": "rollout.max_num_seqs",
    "tensor_parallel_size": "rollout.tensor_parallel_size",
    "seed": "rollout.options.seed",
    "enable_prefix_caching": "rollout.options.enable_prefix_caching",
    "enforce_eager": "rollout.options.enforce_eager",
    "max_num_batched_tokens": "rollout.options.max_num_batched_tokens",
    "kv_cache_memory_bytes": "rollout.kv_cache_bytes",
    "gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "trust_remote_code": "model.trust_remote_code",
    "skip_tokenizer_init": "nothing: geartrain passes token ids and needs it on",
}


class VllmOptions(BaseModel):
    """vLLM-specific settings. The generic limits (dtype, max length, KV-cache budget,
    tensor-parallel size, max sequences, GPU memory share) live in ``RolloutConfig``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enforce_eager: bool | None = None
    """No CUDA graphs / torch.compile: fast start-up, and the only mode on CPU. Default: on
    CPU only (:meth:`eager`); on a GPU vLLM captures its decode in CUDA graphs."""
    seed: int = 0
    """Engine seed (used by requests that carry no seed of their own)."""
    seeded_requests: Literal["per_sample", "per_prompt"] = "per_sample"
    """How a seeded call (``sampling.seed`` set) asks for its ``n`` samples of a prompt:
    ``per_sample``: ``n`` requests of one sample, each seeded with
    :func:`geartrain.seeding.sample_seed` (a sample is the same whichever rank generates it
    and whatever else is in the call, but vLLM samples every seeded request with its own
    generator, row by row); ``per_prompt``: one request of ``n`` samples per prompt with no
    seed of its own, drawn from the engine's ``seed`` (vLLM's batched sampler; a run
    repeats only as a whole). Greedy and unseeded calls are unaffected."""
    enable_prefix_caching: bool = True
    """Share the KV cache of common prompt prefixes (GRPO's n samples share their prompt)."""
    max_num_batched_tokens: int | None = Field(None, ge=1)
    """Scheduler token budget per engine step; ``None`` lets vLLM choose."""
    sleep_level: Literal[1, 2] = 1
    """GPU ``release``: level 1 offloads weights to host memory and drops the KV cache;
    level 2 drops the weights too (``resume`` then reloads the last synced weights)."""
    weight_sync: Literal["auto", "stream", "buckets"] = "auto"
    """``stream``: one ``reload_weights`` call consuming the whole (name, tensor) iterator
    in the engine's process (needs the in-process executor); ``buckets``: one call per
    bucket of at most ``RolloutConfig.weight_bucket_bytes`` (works with worker processes);
    ``auto``: ``stream`` when the engine runs in this process."""
    keep_weights_copy: bool | None = None
    """Keep a host copy of the last synced weights, so a released CPU engine (which has no
    sleep mode and is shut down) restarts with them. ``None``: on CPU only."""
    spill_weights_to_disk: bool = True
    """On CPU ``release``, write that copy to a safetensors file in the work directory and
    drop it from memory; ``resume`` streams it back from disk."""
    work_dir: str | None = None
    """Where the model directory of a tiny model and spilled weights go; default: a
    temporary directory removed at ``shutdown``."""
    pad_token_id: int | None = None
    """Id written into padding positions; default: the model config's ``pad_token_id``, else 0."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for ``vllm.LLM`` (those geartrain sets from a setting of its own
    are refused, naming the setting: :data:`OWNED_ENGINE_KWARGS`)."""

    @field_validator("engine_kwargs")
    @classmethod
    def _not_owned(cls, value: dict[str, Any]) -> dict[str, Any]:
        owned = [f"{key} (set {OWNED_ENGINE_KWARGS[key]})" for key in value if key in OWNED_ENGINE_KWARGS]
        if owned:
            raise ValueError(f"geartrain sets these itself from its own settings: {'; '.join(owned)}")
        return value

    def eager(self, device: str) -> bool:
        """``enforce_eager`` for an engine on ``device``: as set, else on CPU only."""
        return self.enforce_eager if self.enforce_eager is not None else device == "cpu"
