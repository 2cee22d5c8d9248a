"""The vLLM rollout handle: one ``vllm.LLM`` plus what is needed to release and resume it."""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from geartrain.batch import Batch
from geartrain.config import ModelConfig, RolloutConfig
from geartrain.errors import GeartrainError
from geartrain.layout import check_generate_inputs, samples_batch
from geartrain.memory import collect_garbage, current_memory_bytes, device_memory_in_use, measured_move
from geartrain.modeling import build_hf_model, model_directory, pad_token_id
from geartrain.types import EngineContext, MemoryStats, SamplingParams
from geartrain.weights import UnknownTensorError, WeightCopy, bucketed, checked, tied_aliases, with_aliases

from geartrain_vllm import adapters, engine, weights
from geartrain_vllm.options import VllmOptions
from geartrain_vllm.outputs import samples_from_outputs
from geartrain_vllm.requests import build_requests


class VllmRollout:
    """What ``build_rollout`` returns and the other hooks receive.

    On GPU, ``release``/``resume`` are vLLM's sleep/wake-up. On CPU vLLM has no sleep mode,
    so ``release`` shuts the engine down and ``resume`` starts a new one from the model
    directory and streams the last synced weights (kept in :attr:`weight_copy`) into it.
    """

    def __init__(self, config: RolloutConfig, model: ModelConfig, ctx: EngineContext, options: VllmOptions) -> None:
        self.config = config
        self.model = model
        self.ctx = ctx
        self.options = options
        self.device = "cuda" if ctx.device.startswith("cuda") else "cpu"
        engine.check_supported(model, self.device, config, options)
        self._owns_work_dir = options.work_dir is None
        self.work_dir = Path(options.work_dir or tempfile.mkdtemp(prefix="geartrain-vllm-"))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        if self._owns_work_dir:  # also when a later step of the start fails, or shutdown is never called
            self._remove_work_dir = weakref.finalize(self, shutil.rmtree, str(self.work_dir), ignore_errors=True)
        self.model_dir = model_directory(model, self.work_dir)
        self.pad_token_id = pad_token_id(model, options.pad_token_id)
        # The names update_weights accepts: the transformers state dict's (built on meta, free).
        skeleton = build_hf_model(model, meta=True)
        self.tensor_names = frozenset(skeleton.state_dict())
        self.tied = tied_aliases(skeleton)
        self.vocab_size: int = skeleton.config.vocab_size
        del skeleton
        self.engine_kwargs = engine.engine_kwargs(config, model, options, self.model_dir, self.device)
        if config.max_lora_rank is not None:
            self.engine_kwargs.update(adapters.lora_engine_kwargs(config.max_lora_rank))
        self.adapter = adapters.AdapterSlot(config.max_lora_rank)
        keep = options.keep_weights_copy
        if keep is None:
            keep = self.device == "cpu" or options.sleep_level == 2
        self.weight_copy: WeightCopy | None = WeightCopy(self.work_dir / "synced_weights.safetensors") if keep else None
        self.last_sync: weights.SyncCounter | None = None
        self.released = False
        # vLLM's in-process shutdown tears torch.distributed down; spare a group we did not create.
        self._foreign_process_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.llm: Any = engine.start_engine(self.engine_kwargs)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Batch:
        """``sampling.n`` samples per prompt, prompt-major, with vLLM's raw log-probs
        (see :func:`geartrain_vllm.requests.build_requests` for how they are asked for)."""
        self._require_running("generate")
        # the whole batch before any of it reaches the engine (vLLM would keep the requests
        # it accepted before a bad one queued)
        check_generate_inputs(
            "vllm", prompts, sampling, max_model_len=self.config.max_model_len, vocab_size=self.vocab_size
        )
        requests = build_requests(prompts, sampling, per_prompt=self.options.seeded_requests == "per_prompt")
        outputs = self.llm.generate(
            requests.prompts, requests.params, use_tqdm=False, lora_request=self.adapter.request
        )
        return samples_batch(samples_from_outputs(prompts, requests.owners, outputs, sampling), self.pad_token_id)

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> weights.SyncCounter:
        """Load the streamed tensors (consumed once, lazily) and reset the prefix cache.
        While a CPU engine is released they only update the weight copy it restarts from."""
        counter = weights.SyncCounter()
        stream: Iterable[tuple[str, torch.Tensor]] = weights.timed_stream(named_tensors, counter)
        stream = checked(stream, self.tensor_names)
        if self.weight_copy is not None:
            stream = self.weight_copy.tee(stream)
        if self.released:
            if self.device != "cpu" or self.weight_copy is None:
                raise GeartrainError("vllm rollout: update_weights while released; call resume() first")
            for _ in stream:
                pass
        else:
            self._load(stream)
        self.last_sync = counter
        return counter

    def update_adapter(self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        """Serve LoRA adapter ``name`` on top of the synced base (see :mod:`geartrain_vllm.adapters`);
        while a CPU engine is released it is loaded at ``resume``."""
        if self.released and self.device != "cpu":
            raise GeartrainError("vllm rollout: update_adapter while released; call resume() first")
        self.adapter.update(self.llm, name, tensors, config)

    def _load(self, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        mode = self.options.weight_sync
        if mode == "auto":
            mode = "stream" if engine.runs_in_process(self.llm) else "buckets"
        # vLLM keeps a tied output layer as its own layer (on CPU with a repacked copy of the
        # weight), refreshed only when a tensor is loaded under its name
        stream = with_aliases(stream, self.tied)
        with engine.quiet_partial_reload():
            try:
                if mode == "stream":
                    self.llm.collective_rpc(
                        "reload_weights", kwargs=dict(weights_iterator=stream, is_checkpoint_format=True)
                    )
                else:
                    self.llm.collective_rpc(weights.begin_reload)
                    for bucket in bucketed(stream, self.config.weight_bucket_bytes):
                        self.llm.collective_rpc(weights.load_bucket, args=(bucket,))
                    self.llm.collective_rpc(weights.finish_reload)
            except Exception as exc:
                # Put back the tensors of layers that received nothing, so the engine stays usable.
                self.llm.collective_rpc(weights.finish_reload)
                self.llm.reset_prefix_cache()
                unknown = _find_cause(exc, UnknownTensorError)
                if unknown is not None:
                    raise GeartrainError(
                        f"vllm rollout: update_weights got tensor '{unknown.name}', which the model does not have "
                        f"(expected transformers names such as '{min(self.tensor_names)}')"
                    ) from exc
                raise
        self.llm.reset_prefix_cache()

    # ------------------------------------------------------------------ memory
    def release(self) -> MemoryStats:
        """Free the engine's weights and KV cache (GPU: sleep; CPU: shutdown)."""
        if not self.released:
            collect_garbage(self.device)
        return measured_move(self._memory, self._release, done=self.released)

    def _release(self) -> dict[str, int]:
        detail: dict[str, int] = {}
        if self.device == "cpu":
            llm, self.llm = self.llm, None
            # The default group stays: vLLM re-joins it at resume, and another component of
            # this process (the trainer's device mesh) may have adopted it meanwhile.
            engine.stop_engine(llm, keep_default_group=True)
            del llm
            if self.weight_copy is not None:
                detail.update(self.weight_copy.released(spill=self.options.spill_weights_to_disk))
        else:
            self.llm.sleep(level=self.options.sleep_level)
        collect_garbage(self.device)
        engine.trim_heap()
        self.released = True
        return detail

    def resume(self) -> MemoryStats:
        """Re-acquire the memory with the weights the engine had before ``release``."""
        return measured_move(self._memory, self._resume, done=not self.released)

    def _resume(self) -> None:
        if self.device == "cpu":
            self.llm = engine.start_engine(self.engine_kwargs)
            if self.weight_copy is not None and len(self.weight_copy):
                # Read back one tensor at a time; the copy stays on disk until the next sync.
                self._load(self.weight_copy.items())
            self.adapter.reload(self.llm)
        else:
            self.llm.wake_up()
            if self.options.sleep_level == 2:
                if self.weight_copy is not None and len(self.weight_copy):
                    self._load(self.weight_copy.items())
                else:
                    self.llm.collective_rpc("reload_weights", kwargs=dict(is_checkpoint_format=True))
            self.llm.reset_prefix_cache()
        self.released = False

    def shutdown(self) -> None:
        """Stop the engine for good; remove the temporary work directory."""
        if self.llm is not None:
            llm, self.llm = self.llm, None
            engine.stop_engine(llm, keep_default_group=self._foreign_process_group)
        if self.weight_copy is not None:
            self.weight_copy.clear()
        self.adapter.clear()
        if self._owns_work_dir:
            self._remove_work_dir()

    def _memory(self) -> int:
        """Device memory in use (the driver's figure on GPU); the resident set on CPU."""
        return device_memory_in_use(self.device, current_memory_bytes)

    def _require_running(self, what: str) -> None:
        if self.released or self.llm is None:
            raise GeartrainError(f"vllm rollout: {what} while released; call resume() first")


def _find_cause(exc: BaseException | None, kind: type[BaseException]) -> Any:
    """``exc`` or the first exception in its cause/context chain that is a ``kind``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
