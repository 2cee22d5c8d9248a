"""Starting, measuring and stopping an ``sglang.Engine``.

SGLang is imported here, inside functions, so the plugin loads (``capabilities``,
``config_schema``) without it. The Engine runs its scheduler (the model, the KV cache) and
its detokenizer in child processes; the driver process keeps the tokenizer manager.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
from geartrain.config import ModelConfig, RolloutConfig
from geartrain.modeling import hf_config

from geartrain_sglang import cpu_shims
from geartrain_sglang.options import SglangOptions

#: KV-cache budget on CPU when neither ``max_total_tokens`` nor ``kv_cache_bytes`` is set:
#: what ``max_num_seqs`` full-length sequences need, clamped to this range.
CPU_KV_CACHE_MIN_BYTES = 32 << 20
CPU_KV_CACHE_MAX_BYTES = 2 << 30
#: SGLang accepts prompts of at most ``context_length - 6`` tokens (one position for the
#: first generated token, five reserved); the engine's context is that much longer than
#: ``max_model_len``, and geartrain caps prompt + response at ``max_model_len`` itself.
CONTEXT_MARGIN = 6


def configure_environment(device: str) -> None:
    """Environment SGLang reads at import and in its child processes.

    * ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``: report log-probs of the model's distribution
      (before temperature / top-k / top-p), as the ``generate`` hook specifies; SGLang's
      default is the temperature-scaled distribution.
    * On CPU: ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's CPU platform) and the import
      placeholders of :mod:`geartrain_sglang.cpu_shims` in this and every child process.
    """
    os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
    # the margin positions of CONTEXT_MARGIN are never used (see engine_kwargs)
    os.environ["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
    if device == "cpu":
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        os.environ[cpu_shims.ENV_VAR] = "1"
        cpu_shims.install()


def kv_cache_bytes_per_token(model: ModelConfig, dtype_bytes: int) -> int:
    hf = hf_config(model)
    text = getattr(hf, "text_config", None) or hf
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def cpu_kv_cache_tokens(config: RolloutConfig, model: ModelConfig) -> int:
    """KV-cache pool tokens on CPU: ``kv_cache_bytes`` if set, else enough for
    ``max_num_seqs`` full-length sequences, clamped to 32 MiB .. 2 GiB."""
    per_token = kv_cache_bytes_per_token(model, 4 if config.dtype == "float32" else 2)
    budget = config.kv_cache_bytes
    if budget is None:
        need = config.max_num_seqs * config.max_model_len * per_token
        budget = min(max(need, CPU_KV_CACHE_MIN_BYTES), CPU_KV_CACHE_MAX_BYTES)
    return max(budget // per_token, config.max_model_len + CONTEXT_MARGIN)


def engine_kwargs(
    config: RolloutConfig,
    model: ModelConfig,
    options: SglangOptions,
    model_dir: Path,
    device: str,
    architecture: str,
) -> dict[str, Any]:
    """Keyword arguments of ``sglang.Engine`` for this rollout.

    The checkpoint's EOS ids are cleared (``json_model_override_args``): SGLang stops a
    sample at them unless ``ignore_eos``, which would also ignore ``stop_token_ids``; the
    hook's contract is that only ``stop_token_ids`` stop a sample. ``architecture`` (the
    transformers class the trainer builds) is filled in when the directory's config lacks
    ``architectures``, which SGLang needs to pick its model class."""
    hf = hf_config(model)
    text = getattr(hf, "text_config", None) or hf
    positions = getattr(text, "max_position_embeddings", None)
    if positions is not None and config.max_model_len > positions:
        from geartrain.errors import GeartrainError

        raise GeartrainError(
            f"sglang rollout: rollout.max_model_len={config.max_model_len} exceeds the model's "
            f"max_position_embeddings={positions}"
        )
    kwargs: dict[str, Any] = dict(
        model_path=str(model_dir),
        # token ids in, token ids out: no tokenizer, no detokenisation
        skip_tokenizer_init=True,
        dtype=config.dtype,
        context_length=config.max_model_len + CONTEXT_MARGIN,
        json_model_override_args=json.dumps(
            {"eos_token_id": None, **({} if getattr(hf, "architectures", None) else {"architectures": [architecture]})}
        ),
        max_running_requests=config.max_num_seqs,
        tp_size=config.tensor_parallel_size,
        random_seed=options.seed,
        mem_fraction_static=config.gpu_memory_utilization,
        trust_remote_code=model.trust_remote_code,
        log_level=options.log_level,
    )
    if options.attention_backend is not None:
        kwargs["attention_backend"] = options.attention_backend
    if options.max_total_tokens is not None:
        kwargs["max_total_tokens"] = options.max_total_tokens
    if device != "cpu":
        # per-request seeds (SamplingParams.seed) are honoured only in deterministic mode
        # (on CPU, cpu_shims gives the sampler the seeds instead: that mode refuses CPU backends)
        kwargs["enable_deterministic_inference"] = True
    else:
        kwargs["device"] = "cpu"
        kwargs.setdefault("attention_backend", "torch_native")
        kwargs["disable_cuda_graph"] = True
        # An idle scheduler otherwise polls its sockets in a busy loop, a whole core taken
        # from the trainer between generate calls (measured: bench/RESULTS.md); with this it
        # blocks on them and wakes as soon as a request arrives.
        kwargs["sleep_on_idle"] = True
        kwargs.setdefault("max_total_tokens", cpu_kv_cache_tokens(config, model))
        if config.tensor_parallel_size != 1:
            from geartrain.errors import GeartrainError

            raise GeartrainError("sglang rollout: tensor_parallel_size > 1 needs GPUs (the CPU recipe runs one rank)")
    if config.max_lora_rank is not None:
        # adapters come in through update_adapter (load_lora_adapter_from_tensors), none at start
        kwargs.update(
            enable_lora=True,
            max_lora_rank=config.max_lora_rank,
            lora_target_modules=["all"],
            max_loras_per_batch=2,  # the adapter and base-only requests
        )
        if device == "cpu":
            kwargs["lora_backend"] = "torch_native"
    kwargs.update(options.engine_kwargs)
    return kwargs


@contextlib.contextmanager
def _child_environment(extra: dict[str, str]) -> Iterator[None]:
    """``extra`` in the environment while the engine spawns its processes (they inherit
    it), without changing this process's settings for good; a user's own value wins."""
    added = {k: v for k, v in extra.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def start_engine(kwargs: dict[str, Any], device: str, cpu_threads: int | None = 1) -> Any:
    """A new ``sglang.Engine`` (its child processes started and ready).

    On CPU the engine's processes run with ``TORCHDYNAMO_DISABLE=1``: SGLang compiles its
    seeded sampler with ``torch.compile(dynamic=True)``, which on CPU means minutes of C++
    builds (and rebuilds per shape) for a few element-wise ops; and with
    ``OMP_NUM_THREADS=cpu_threads`` (see :attr:`~geartrain_sglang.options.SglangOptions.cpu_threads`)."""
    configure_environment(device)
    import sglang

    child: dict[str, str] = {}
    if device == "cpu":
        child["TORCHDYNAMO_DISABLE"] = "1"
        if cpu_threads is not None:
            child["OMP_NUM_THREADS"] = str(cpu_threads)
    with _child_environment(child):
        return sglang.Engine(**kwargs)


def child_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def tree_rss(pids: set[int]) -> int:
    """Resident set of this process plus ``pids`` (the engine's processes), in bytes."""
    total = psutil.Process().memory_info().rss
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_info().rss
    return total


@contextlib.contextmanager
def _only_kill(pids: set[int]) -> Iterator[None]:
    """``Engine.shutdown`` kills every child of this process; restrict it to the engine's
    own processes, so a trainer's children (data loaders, Ray, another engine) survive."""
    import psutil as _psutil
    import sglang.srt.entrypoints.engine as engine_module

    original = engine_module.kill_process_tree

    def kill_engine_processes(parent_pid: int, include_parent: bool = True, **_: Any) -> None:
        if parent_pid != os.getpid() or include_parent:
            original(parent_pid, include_parent=include_parent)
            return
        procs = []
        for pid in pids:
            with contextlib.suppress(_psutil.NoSuchProcess):
                proc = _psutil.Process(pid)
                proc.kill()
                procs.append(proc)
        _psutil.wait_procs(procs, timeout=60)

    engine_module.kill_process_tree = kill_engine_processes
    try:
        yield
    finally:
        engine_module.kill_process_tree = original


def stop_engine(engine: Any, pids: set[int]) -> None:
    """Shut the engine down: its child processes (model, KV cache) exit."""
    with _only_kill(pids):
        engine.shutdown()
    trim_heap()


def trim_heap() -> None:
    """Ask glibc to hand freed heap pages back to the OS; a no-op elsewhere."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
