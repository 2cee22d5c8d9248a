"""Starting and stopping a ``vllm.LLM`` in this process.

vLLM is imported here, inside functions, so the plugin loads (``capabilities``,
``config_schema``) without it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import glob
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from geartrain.config import ModelConfig, RolloutConfig
from geartrain.errors import ConfigError, GeartrainError
from geartrain.modeling import hf_config

from geartrain_vllm.options import VllmOptions

#: Head sizes vLLM's CPU attention kernels support (vllm/v1/attention/backends/cpu_attn.py).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
#: ``ModelConfig.config_overrides`` that give geartrain's tiny models (64 wide, 4 heads of 16)
#: a head size vLLM's CPU kernels support: 2 heads of 32.
CPU_TINY_OVERRIDES: dict[str, dict[str, int]] = {
    "qwen2": {"num_attention_heads": 2, "num_key_value_heads": 1},
    "llama": {"num_attention_heads": 2, "num_key_value_heads": 2},
}
#: KV-cache budget on CPU when ``RolloutConfig.kv_cache_bytes`` is unset: what
#: ``max_num_seqs`` full-length sequences need, clamped to this range.
CPU_KV_CACHE_MIN_BYTES = 32 << 20
CPU_KV_CACHE_MAX_BYTES = 2 << 30
#: vLLM's KV-cache block on CPU, in tokens (its default; ``engine_kwargs`` may set another).
CPU_BLOCK_SIZE = 128


def configure_environment() -> None:
    """Environment vLLM reads at start-up: keep the engine in this process (so weights can
    be streamed to it without serialisation) unless the user chose otherwise."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def head_size(model: ModelConfig) -> int:
    hf = hf_config(model)
    text = getattr(hf, "text_config", None) or hf
    explicit = getattr(text, "head_dim", None)
    return int(explicit or text.hidden_size // text.num_attention_heads)


def kv_cache_bytes_per_token(model: ModelConfig, dtype_bytes: int) -> int:
    hf = hf_config(model)
    text = getattr(hf, "text_config", None) or hf
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return 2 * text.num_hidden_layers * kv_heads * head_size(model) * dtype_bytes


def default_cpu_kv_cache_bytes(config: RolloutConfig, model: ModelConfig) -> int:
    dtype_bytes = 4 if config.dtype == "float32" else 2
    need = config.max_num_seqs * config.max_model_len * kv_cache_bytes_per_token(model, dtype_bytes)
    return int(min(max(need, CPU_KV_CACHE_MIN_BYTES), CPU_KV_CACHE_MAX_BYTES))


def _numa_nodes() -> int:
    """This machine's NUMA nodes (1 where Linux's list of them cannot be read)."""
    nodes = glob.glob("/sys/devices/system/node/node[0-9]*")
    return max(1, len(nodes))


def check_supported(
    model: ModelConfig, device: str, config: RolloutConfig | None = None, options: VllmOptions | None = None
) -> None:
    """Refuse, with the fix, what vLLM's CPU backend cannot run: a model's head size its
    kernels lack, a tensor-parallel size above the machine's NUMA nodes (it places one rank
    on each: an AssertionError deep in its start), a KV cache too small for one sequence of
    ``rollout.max_model_len`` (its start failed advising gpu_memory_utilization)."""
    if device != "cpu":
        return
    if config is not None and config.tensor_parallel_size > (nodes := _numa_nodes()):
        raise ConfigError(
            [
                (
                    "tensor_parallel_size",
                    f"{config.tensor_parallel_size}: vLLM's CPU backend puts each tensor-parallel rank on a NUMA "
                    f"node of its own and this machine has {nodes}; set it to at most {nodes} (1 on most machines)",
                )
            ]
        )
    if config is not None and config.kv_cache_bytes is not None:
        block = int((options.engine_kwargs if options is not None else {}).get("block_size", CPU_BLOCK_SIZE))
        tokens = -(-config.max_model_len // block) * block
        need = tokens * kv_cache_bytes_per_token(model, 4 if config.dtype == "float32" else 2)
        if config.kv_cache_bytes < need:
            raise ConfigError(
                [
                    (
                        "kv_cache_bytes",
                        f"{config.kv_cache_bytes:,} bytes hold less than one sequence of rollout.max_model_len="
                        f"{config.max_model_len} tokens ({tokens} in blocks of {block}: {need:,} bytes for this "
                        "model); give at least that, or leave it unset for a size that fits max_num_seqs sequences",
                    )
                ]
            )
    size = head_size(model)
    if size not in CPU_HEAD_SIZES:
        raise GeartrainError(
            f"vLLM's CPU attention supports head sizes {list(CPU_HEAD_SIZES)}, this model has {size}. "
            "For a tiny model, set model.config_overrides so hidden_size / num_attention_heads is one of "
            "them (e.g. num_attention_heads=2, num_key_value_heads=1 for the 64-wide tiny qwen2)."
        )


def engine_kwargs(
    config: RolloutConfig, model: ModelConfig, options: VllmOptions, model_dir: Path, device: str
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for this rollout."""
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        # token ids in, token ids out: no tokenizer, no detokenisation
        skip_tokenizer_init=True,
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        tensor_parallel_size=config.tensor_parallel_size,
        enforce_eager=options.eager(device),
        seed=options.seed,
        enable_prefix_caching=options.enable_prefix_caching,
        # sampling comes only from the request, never from the checkpoint's generation_config
        generation_config="vllm",
        trust_remote_code=model.trust_remote_code,
    )
    if options.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = options.max_num_batched_tokens
    if device == "cpu":
        kwargs["kv_cache_memory_bytes"] = config.kv_cache_bytes or default_cpu_kv_cache_bytes(config, model)
        # A prompt prefilled in chunks has its sampled token discarded and vLLM then rewinds
        # the request's seeded generator by an offset, which CPU generators do not have
        # ("CPU Generator does not use offset"): seeded sampling needs whole-prompt prefill.
        kwargs["enable_chunked_prefill"] = False
    else:
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = True
        if config.kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = config.kv_cache_bytes
    kwargs.update(options.engine_kwargs)
    return kwargs


def start_engine(kwargs: dict[str, Any]) -> Any:
    """A new ``vllm.LLM``."""
    configure_environment()
    from vllm import LLM

    return LLM(**kwargs)


def runs_in_process(llm: Any) -> bool:
    """Whether the engine's worker lives in this process (so a Python iterator can be
    handed to it as is)."""
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    core = llm.llm_engine.engine_core
    if not isinstance(core, InprocClient):
        return False
    return isinstance(core.engine_core.model_executor, UniProcExecutor)


@contextlib.contextmanager
def _keep_default_process_group(keep: bool) -> Iterator[None]:
    """vLLM's in-process shutdown destroys torch.distributed's default group; when that
    group belongs to someone else (the trainer in the same process), keep it alive."""
    if not keep:
        yield
        return
    import torch.distributed as dist

    original = dist.destroy_process_group

    def destroy_unless_default(group: Any = None) -> None:
        if group is not None:
            original(group)

    dist.destroy_process_group = destroy_unless_default
    try:
        yield
    finally:
        dist.destroy_process_group = original


def stop_engine(llm: Any, *, keep_default_group: bool) -> None:
    """Shut an in-process engine down and return its memory (weights, KV cache) to the OS."""
    with _keep_default_process_group(keep_default_group):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    trim_heap()


@contextlib.contextmanager
def quiet_partial_reload() -> Iterator[None]:
    """vLLM warns once per layer that received no tensors in a reload ("Failed to load
    weights"): expected for rotary embeddings and for partial syncs, noise in a training
    log. Raise that one logger to ERROR for the duration."""
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def trim_heap() -> None:
    """Ask glibc to hand freed heap pages back to the OS, so the resident set (what the
    CPU release measures) drops; a no-op elsewhere."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
