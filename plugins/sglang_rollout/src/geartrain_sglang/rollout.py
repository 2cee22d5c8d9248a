"""The SGLang rollout handle: one ``sglang.Engine`` plus what is needed to release and resume it."""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from geartrain.batch import Batch
from geartrain.config import ModelConfig, RolloutConfig
from geartrain.errors import GeartrainError
from geartrain.layout import check_generate_inputs, samples_batch
from geartrain.memory import device_memory_in_use, measured_move
from geartrain.modeling import build_hf_model, model_directory, pad_token_id
from geartrain.types import EngineContext, MemoryStats, SamplingParams, SyncStats
from geartrain.weights import (
    BucketStats,
    UnknownTensorError,
    WeightCopy,
    bucketed,
    checked,
    tied_aliases,
    with_aliases,
)

from geartrain_sglang import engine, weights
from geartrain_sglang.options import SglangOptions
from geartrain_sglang.outputs import samples_from_outputs
from geartrain_sglang.requests import build_requests


class SglangRollout:
    """What ``build_rollout`` returns and the other hooks receive.

    On GPU, ``release``/``resume`` are SGLang's ``release_memory_occupation`` /
    ``resume_memory_occupation``. On CPU those free nothing (they need CUDA's memory saver),
    so ``release`` shuts the engine down (its scheduler process, holding weights and KV
    cache, exits) and ``resume`` starts a new one and loads the last synced weights (kept
    in :attr:`weight_copy`) into it.
    """

    def __init__(self, config: RolloutConfig, model: ModelConfig, ctx: EngineContext, options: SglangOptions) -> None:
        self.config = config
        self.model = model
        self.ctx = ctx
        self.options = options
        self.device = "cuda" if ctx.device.startswith("cuda") else "cpu"
        if importlib.util.find_spec("sglang") is None:
            raise GeartrainError(
                "sglang rollout: SGLang is not installed here; "
                "on GPUs `pip install './plugins/sglang_rollout[gpu]'` from the checkout, "
                "on CPU follow the recipe in the plugin's README (plugins/sglang_rollout/README.md)"
            )
        self._owns_work_dir = options.work_dir is None
        self.work_dir = Path(options.work_dir or tempfile.mkdtemp(prefix="geartrain-sglang-"))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        if self._owns_work_dir:  # also when a later step of the start fails, or shutdown is never called
            self._remove_work_dir = weakref.finalize(self, shutil.rmtree, str(self.work_dir), ignore_errors=True)
        self.model_dir = model_directory(model, self.work_dir)
        if self.model_dir.is_relative_to(self.work_dir):
            # SGLang adds a generation config's EOS ids to the ones that stop a sample
            (self.model_dir / "generation_config.json").unlink(missing_ok=True)
        self.pad_token_id = pad_token_id(model, options.pad_token_id)
        # The names update_weights accepts: the transformers state dict's (built on meta, free).
        skeleton = build_hf_model(model, meta=True)
        self.tensor_names = frozenset(skeleton.state_dict())
        self.tied = tied_aliases(skeleton)
        self.vocab_size: int = skeleton.config.vocab_size
        architecture = type(skeleton).__name__
        del skeleton
        self.engine_kwargs = engine.engine_kwargs(config, model, options, self.model_dir, self.device, architecture)
        keep = options.keep_weights_copy if options.keep_weights_copy is not None else self.device == "cpu"
        self.weight_copy: WeightCopy | None = WeightCopy(self.work_dir / "synced_weights.safetensors") if keep else None
        self.last_sync: SyncStats | None = None
        self.released = False
        self._sender: weights.DistributedSender | None = None
        self.engine: Any = None
        self._pids: set[int] = set()
        self.adapter: tuple[str, dict[str, torch.Tensor], dict[str, Any]] | None = None
        """The served LoRA adapter (name, tensors on the host, PEFT config), reloaded after a restart."""
        self._start()

    # ------------------------------------------------------------------ engine lifetime
    def _start(self) -> None:
        before = engine.child_pids()
        self.engine = engine.start_engine(self.engine_kwargs, self.device, self.options.cpu_threads)
        self._pids = engine.child_pids() - before

    def _stop(self) -> None:
        if self._sender is not None:
            self._sender.close(None)
            self._sender = None
        eng, self.engine = self.engine, None
        engine.stop_engine(eng, self._pids)
        self._pids = set()

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Batch:
        """``sampling.n`` samples per prompt, prompt-major, with the model's log-probs
        (see :func:`geartrain_sglang.requests.build_requests`)."""
        self._require_running("generate")
        # the whole batch before any of it reaches the engine (a bad token id would take
        # the scheduler process down with it)
        check_generate_inputs(
            "sglang", prompts, sampling, max_model_len=self.config.max_model_len, vocab_size=self.vocab_size
        )
        requests = build_requests(prompts, sampling, self.config.max_model_len)
        lora = None if self.adapter is None else [self.adapter[0]] * len(requests.input_ids)
        outputs = self.engine.generate(
            input_ids=requests.input_ids, sampling_params=requests.params, return_logprob=True, lora_path=lora
        )
        return samples_batch(samples_from_outputs(prompts, requests.owners, outputs, sampling), self.pad_token_id)

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncStats:
        """Load the streamed tensors (consumed once, lazily, bucket by bucket) between
        ``begin_weight_update`` and ``end_weight_update``, then flush the prefix cache.
        While a CPU engine is released they only update the weight copy it restarts from."""
        start = time.perf_counter()
        stats = BucketStats()
        stream: Iterable[tuple[str, torch.Tensor]] = weights.counted(named_tensors, stats)
        stream = checked(stream, self.tensor_names)
        if self.weight_copy is not None:
            stream = self.weight_copy.tee(stream)
        if self.released:
            if self.weight_copy is None:
                raise GeartrainError("sglang rollout: update_weights while released; call resume() first")
            for _ in stream:
                pass
        else:
            self._load(stream, stats)
        self.last_sync = SyncStats(
            seconds=time.perf_counter() - start,
            bytes=stats.bytes,
            num_tensors=stats.num_tensors,
            num_buckets=stats.num_buckets,
            max_bucket_bytes=stats.max_bucket_bytes,
        )
        return self.last_sync

    def update_adapter(self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        """Serve LoRA adapter ``name`` through SGLang's in-memory adapter loading
        (``Engine.load_lora_adapter_from_tensors``: no files), replacing the previous one;
        while a CPU engine is released it is loaded at ``resume``."""
        if self.config.max_lora_rank is None:
            raise GeartrainError(
                "sglang rollout: update_adapter needs rollout.max_lora_rank (the engine starts without LoRA)"
            )
        if int(config["r"]) > self.config.max_lora_rank:
            raise GeartrainError(
                f"sglang rollout: adapter rank {config['r']} exceeds "
                f"rollout.max_lora_rank ({self.config.max_lora_rank})"
            )
        if self.released and self.device != "cpu":
            raise GeartrainError("sglang rollout: update_adapter while released; call resume() first")
        held = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}
        previous, self.adapter = self.adapter, (name, held, dict(config))
        if self.released:
            return
        if previous is not None:
            _check_lora(self.engine.unload_lora_adapter(previous[0]), "unload_lora_adapter")
        self._load_adapter()

    def _load_adapter(self) -> None:
        if self.adapter is not None:
            name, tensors, config = self.adapter
            _check_lora(
                self.engine.load_lora_adapter_from_tensors(name, tensors, config), "load_lora_adapter_from_tensors"
            )

    def _load(self, stream: Iterable[tuple[str, torch.Tensor]], stats: BucketStats) -> None:
        eng = self.engine
        stream = with_aliases(stream, self.tied)
        eng.begin_weight_update()
        try:
            for bucket in bucketed(stream, self.config.weight_bucket_bytes):
                stats.num_buckets += 1
                nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
                stats.max_bucket_bytes = max(stats.max_bucket_bytes, nbytes)
                if self.options.weight_sync == "distributed":
                    self._distributed_sender().send(eng, bucket)
                else:
                    weights.check_result(
                        eng.update_weights_from_tensor(bucket, flush_cache=False), "update_weights_from_tensor"
                    )
        except UnknownTensorError as exc:
            raise GeartrainError(
                f"sglang rollout: update_weights got tensor '{exc.name}', which the model does not have "
                f"(expected transformers names such as '{min(self.tensor_names)}')"
            ) from exc
        finally:
            # The prefix cache holds KV computed with the old weights. Engine.flush_cache
            # would also empty the allocator's cache, which on CPU is a full gc.collect() in
            # the scheduler (0.6-0.8 s, most of a sync: bench/RESULTS.md); an update with no
            # tensors flushes the same pools without it.
            weights.check_result(eng.update_weights_from_tensor([], flush_cache=True), "flush_cache")
            eng.end_weight_update()

    def _distributed_sender(self) -> weights.DistributedSender:
        if self._sender is None:
            self._sender = weights.DistributedSender(
                self.engine,
                backend="gloo" if self.device == "cpu" else "nccl",
                world_size=1 + self.config.tensor_parallel_size,
            )
        return self._sender

    # ------------------------------------------------------------------ memory
    def release(self) -> MemoryStats:
        """Free the engine's weights and KV cache (GPU: SGLang's memory release; CPU: shutdown)."""
        return measured_move(self._memory, self._release, done=self.released)

    def _release(self) -> dict[str, int]:
        detail: dict[str, int] = {}
        if self.device == "cpu":
            self._stop()
            if self.weight_copy is not None:
                detail.update(self.weight_copy.released(spill=self.options.spill_weights_to_disk))
            engine.trim_heap()
        else:
            self.engine.release_memory_occupation()
        self.released = True
        return detail

    def resume(self) -> MemoryStats:
        """Re-acquire the memory and the last synced weights."""
        return measured_move(self._memory, self._resume, done=not self.released)

    def _resume(self) -> None:
        if self.device == "cpu":
            self._start()
            self.released = False
            if self.weight_copy is not None and len(self.weight_copy):
                self._load(self.weight_copy.items(), BucketStats())
            self._load_adapter()
        else:
            self.engine.resume_memory_occupation()
            self.released = False

    def shutdown(self) -> None:
        """Stop the engine for good; remove the temporary work directory."""
        if self.engine is not None:
            self._stop()
        if self.weight_copy is not None:
            self.weight_copy.clear()
        if self._owns_work_dir:
            self._remove_work_dir()

    def _memory(self) -> int:
        """Device memory in use on GPU; on CPU the resident set of this process plus the
        engine's processes (the scheduler holds the weights and the KV cache)."""
        return device_memory_in_use(self.device, lambda: engine.tree_rss(self._pids))

    def _require_running(self, what: str) -> None:
        if self.released or self.engine is None:
            raise GeartrainError(f"sglang rollout: {what} while released; call resume() first")


def _check_lora(result: Any, what: str) -> None:
    """SGLang's LoRA calls return a ``LoRAUpdateOutput`` (``success``, ``error_message``)."""
    if getattr(result, "success", True) is False:
        raise GeartrainError(f"sglang rollout: {what} failed: {getattr(result, 'error_message', result)}")
