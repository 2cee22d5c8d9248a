"""Plain data types shared by the core and every backend plugin.

These are the values that cross the hook boundary. Backends receive and return them; the
core never looks inside a backend's own handles (``EngineModel`` / ``RolloutEngine``).

Tensor layout convention (all backends follow it, see docs/architecture.md):

* A batch holds ``input_ids`` ``[B, T]`` = left-padded prompt followed by the right-padded
  response, with ``attention_mask`` ``[B, T]`` (1 on real tokens).
* Every per-token tensor is aligned to ``input_ids``: position ``t`` holds the quantity for
  *predicting token t* from the tokens before it (``log_probs[:, t] = log p(x_t | x_<t)``,
  ``values[:, t] = V(x_<t)``). Each sequence's first real token (it has no context) and
  padding hold 0.
* ``loss_mask`` / ``response_mask`` ``[B, T]`` select the tokens a loss is taken over.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

if TYPE_CHECKING:
    from geartrain.batch import Batch

#: A backend's own training handle (module, optimizer, scheduler, mesh...). Opaque to the core.
EngineModel: TypeAlias = Any
#: A backend's own inference handle. Opaque to the core.
RolloutEngine: TypeAlias = Any


@dataclass(kw_only=True, slots=True)
class EngineContext:
    """Where an engine or rollout instance runs.

    The worker group fills this in before any hook is called. ``torch.distributed`` is
    already initialised (gloo on CPU, NCCL on GPU) when ``world_size > 1``.
    """

    role: str
    """Role name: ``actor``, ``critic``, ``reference``, ``reward`` or ``rollout``."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"
    """``"cpu"`` or ``"cuda"``; a backend places tensors on ``torch.device(device, local_rank)``."""
    seed: int = 0
    """Seed for anything random the backend does at build time (initialisation, dropout)."""
    process_group: Any = None
    """The group the role's ranks share; ``None`` means the default (world) group."""


@dataclass(kw_only=True, slots=True)
class DataParallelCoordinates:
    """Which slice of a batch a rank consumes.

    Ranks with the same ``rank`` (e.g. the members of one sequence- or tensor-parallel
    group) receive the same slice and must return the same outputs.
    """

    rank: int
    size: int


@dataclass(kw_only=True, slots=True)
class LossContext:
    """Global counts a loss function needs so its result does not depend on how the batch
    was split into micro-batches or across data-parallel ranks."""

    global_tokens: int
    """Number of ``loss_mask`` tokens in the whole step, summed over all data-parallel ranks."""
    global_sequences: int
    """Number of sequences in the whole step, summed over all data-parallel ranks."""
    dp_size: int = 1
    micro_batch_index: int = 0
    num_micro_batches: int = 1


LossFn: TypeAlias = Callable[
    [dict[str, torch.Tensor], "Batch", LossContext], tuple[torch.Tensor, dict[str, float]]
]
"""``loss_fn(outputs, micro_batch, ctx) -> (loss, metrics)``.

``outputs`` holds per-token tensors ``[b, T]`` for the micro-batch (``log_probs`` always;
``entropy`` when asked for; ``values`` for value models), aligned to its ``input_ids``.
``loss`` is this micro-batch's *share* of the global loss (e.g. a token sum divided by
``ctx.global_tokens``): the engine arranges for the gradient to equal the gradient of the
sum of all shares over micro-batches and data-parallel ranks. ``metrics`` are shares in
the same sense; the engine sums them over micro-batches and ranks.
"""


@dataclass(kw_only=True, slots=True)
class StepOutput:
    """Result of ``forward_backward``.

    ``outputs`` are per-token tensors ``[B, T]`` for the batch the caller passed in, in its
    original order, on CPU. ``metrics`` are the loss function's metrics summed over
    micro-batches and data-parallel ranks, plus the engine's own (e.g. ``tokens``).
    """

    outputs: dict[str, torch.Tensor]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(kw_only=True, slots=True)
class SyncStats:
    """What one weight synchronisation moved (``reshard_for_rollout``)."""

    seconds: float
    bytes: int
    num_tensors: int
    num_buckets: int
    max_bucket_bytes: int = 0


@dataclass(kw_only=True, slots=True)
class MemoryStats:
    """Memory around an offload/onload or release/resume, in bytes.

    ``before``/``after`` are what the backend measured (device memory on GPU, the process's
    resident set on CPU); ``freed`` is positive when memory was released.
    """

    before: int
    after: int
    seconds: float
    detail: dict[str, int] = field(default_factory=dict)

    @property
    def freed(self) -> int:
        return self.before - self.after


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How a rollout samples. ``n`` samples per prompt are returned prompt-major:
    sample ``j`` of prompt ``i`` is row ``i * n + j``."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """``-1`` or ``0`` disables top-k."""
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation of a sample stops after it emits any of these (the stop token is kept)."""
    seed: int | None = None
    """With a seed, the same prompts, weights and settings give the same samples: sample
    ``j`` of prompt ``i`` draws from its own stream seeded with
    ``geartrain.seeding.sample_seed(seed, prompt_indices[i], j)``, whatever else is in the
    call, so a job samples the same tokens on one rank or split across N."""
    prompt_indices: list[int] | None = None
    """Index of each prompt in the whole step's batch, when this call generates only a
    data-parallel share of it; ``None``: ``0 .. len(prompts) - 1``."""


class Capability:
    """Names a plugin may declare through the ``capabilities`` hook."""

    CPU = "cpu"
    CUDA = "cuda"
    DATA_PARALLEL = "data_parallel"
    SEQUENCE_PARALLEL = "sequence_parallel"
    TENSOR_PARALLEL = "tensor_parallel"
    PIPELINE_PARALLEL = "pipeline_parallel"
    OFFLOAD = "offload"
    LORA = "lora"
    VALUE_HEAD = "value_head"
    HF_EXPORT = "hf_export"
    RELEASE_MEMORY = "release_memory"
