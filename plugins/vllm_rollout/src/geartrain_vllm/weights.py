"""Moving weights into a vLLM engine, and the host copy a CPU engine restarts from.

Two transports (``VllmOptions.weight_sync``):

* ``stream``: one ``reload_weights`` RPC whose argument is the caller's (name, tensor)
  iterator itself; vLLM consumes it lazily, loading each layer as soon as its tensors are
  complete. Only possible when the engine's worker lives in this process.
* ``buckets``: the iterator is cut into buckets of at most ``bucket_bytes``
  (:func:`geartrain.weights.bucketed`); each bucket is
  one RPC between a begin and a finish RPC (:func:`begin_reload`, :func:`load_bucket`,
  :func:`finish_reload`, run on every worker). vLLM's layer-wise reload buffers a layer
  until all its tensors arrived, so a bucket boundary may split a fused layer.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

NamedTensors = Iterable[tuple[str, torch.Tensor]]


# --------------------------------------------------------------------------- worker side
# These run inside vLLM's worker (``self`` is the worker) through ``collective_rpc``.


def begin_reload(self: Any) -> None:
    """Worker: prepare the model for a layer-wise reload in checkpoint format."""
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    initialize_layerwise_reload(self.model_runner.get_model())


def load_bucket(self: Any, bucket: list[tuple[str, torch.Tensor]]) -> None:
    """Worker: feed one bucket of checkpoint-named tensors to the model's loader."""
    self.model_runner.get_model().load_weights(iter(bucket))


def finish_reload(self: Any) -> None:
    """Worker: process the layers that received weights and drop derived caches."""
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    runner = self.model_runner
    finalize_layerwise_reload(runner.get_model(), runner.model_config)
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        if hasattr(runner, reset):
            getattr(runner, reset)()


# --------------------------------------------------------------------------- driver side


class SyncCounter:
    """Counts what passes through a weight stream (tensors, bytes, seconds)."""

    def __init__(self) -> None:
        self.num_tensors = 0
        self.bytes = 0
        self.seconds = 0.0

    def count(self, named_tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            self.num_tensors += 1
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor


class WeightCopy:
    """A host copy of the last synced weights (name -> CPU tensor), merged across syncs
    (a sync that names only some tensors updates only those), optionally spilled to one
    safetensors file while the engine is released."""

    def __init__(self, spill_path: Path) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self._names: list[str] = []
        self._spill_path = spill_path
        self._spilled = False

    def __len__(self) -> int:
        return len(self._names)

    @property
    def spilled(self) -> bool:
        return self._spilled

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def tee(self, named_tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass the stream through, keeping a CPU copy of each tensor."""
        self.restore()
        for name, tensor in named_tensors:
            held = self._tensors.get(name)
            if held is not None and held.shape == tensor.shape and held.dtype == tensor.dtype:
                held.copy_(tensor.detach())  # reuse the buffer: no new allocation per sync
            else:
                if held is None:
                    self._names.append(name)
                self._tensors[name] = tensor.detach().to("cpu", copy=True)
            yield name, tensor

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The held tensors (read back one at a time when spilled)."""
        if not self._spilled:
            yield from self._tensors.items()
            return
        from safetensors import safe_open

        with safe_open(str(self._spill_path), framework="pt") as f:
            for name in self._names:
                yield name, f.get_tensor(name)

    def spill(self) -> None:
        """Write the held tensors to disk and drop them from memory."""
        if self._spilled or not self._tensors:
            return
        from safetensors.torch import save_file

        self._spill_path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self._tensors.items()}, str(self._spill_path))
        self._tensors = {}
        self._spilled = True
        gc.collect()

    def restore(self) -> None:
        """Bring spilled tensors back into memory (a sync merges into them)."""
        if not self._spilled:
            return
        from safetensors.torch import load_file

        self._tensors = load_file(str(self._spill_path))
        self._spilled = False
        self._spill_path.unlink(missing_ok=True)

    def clear(self) -> None:
        self._tensors = {}
        self._names = []
        self._spilled = False
        self._spill_path.unlink(missing_ok=True)


def timed_stream(named_tensors: NamedTensors, counter: SyncCounter) -> Iterator[tuple[str, torch.Tensor]]:
    """``counter.count`` plus wall time from the first pull to exhaustion."""
    start = time.perf_counter()
    yield from counter.count(named_tensors)
    counter.seconds = time.perf_counter() - start
