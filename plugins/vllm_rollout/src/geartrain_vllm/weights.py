"""Moving weights into a vLLM engine (the host copy a released CPU engine restarts from is
:class:`geartrain.weights.WeightCopy`).

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

import time
from collections.abc import Iterable, Iterator
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


def timed_stream(named_tensors: NamedTensors, counter: SyncCounter) -> Iterator[tuple[str, torch.Tensor]]:
    """``counter.count`` plus wall time from the first pull to exhaustion."""
    start = time.perf_counter()
    yield from counter.count(named_tensors)
    counter.seconds = time.perf_counter() - start
