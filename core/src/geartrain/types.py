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

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

import torch

from geartrain.tensor_pickle import arrays_to_tensors, plain_cpu, tensors_to_arrays

if TYPE_CHECKING:
    from geartrain.batch import Batch

#: A backend's own training handle (module, optimizer, scheduler, mesh...). Opaque to the core.
EngineModel: TypeAlias = Any
#: A backend's own inference handle. Opaque to the core.
RolloutEngine: TypeAlias = Any


@dataclass(kw_only=True, slots=True)
class EngineContext:
    """Where an engine or rollout instance runs.

    The worker group fills this in before any hook is called and passes the same values to
    every hook that takes a ``ctx``. ``torch.distributed`` is always initialised by then
    (gloo on CPU, NCCL on GPU), also on one rank; a backend never initialises it itself.
    """

    role: str
    """Role name: ``actor``, ``critic``, ``reference``, ``reward`` or ``rollout``."""
    rank: int = 0
    """This rank's index in the role's group (``0 .. world_size - 1``); equals
    ``torch.distributed.get_rank(process_group)``."""
    world_size: int = 1
    """Number of ranks of the role (the product of its ``parallel`` sizes)."""
    local_rank: int = 0
    """Index of this rank on its machine: the accelerator it uses."""
    device: str = "cpu"
    """``"cpu"`` or ``"cuda"``; a backend places tensors on ``torch.device(device, local_rank)``."""
    seed: int = 0
    """Seed for anything random the backend does at build time (initialisation, dropout)."""
    process_group: Any = None
    """The ``torch.distributed`` process group of the role's ranks (``world_size`` members,
    ranks in the order of ``rank``). Always provided by the worker groups: on the inline
    placement a group of size 1 (gloo on CPU, NCCL on GPU, see
    :mod:`geartrain.cluster.process_group`), torn down when the role shuts down; on the Ray
    placement the group of the role's actors. A backend runs its collectives (DDP, FSDP
    meshes, broadcasts) on this group or subgroups of it, and never creates a world of its own.
    Left ``None`` in a context built by hand for one rank (``EngineContext(role="actor")``),
    :class:`geartrain.Engine` and :class:`geartrain.Rollout` supply the size-1 group before any
    hook runs (released with the engine, or by the rollout's ``shutdown``); a context for
    several ranks without a group is refused."""


@dataclass(kw_only=True, slots=True)
class DataParallelCoordinates:
    """Which slice of a batch a rank consumes.

    Ranks with the same ``rank`` (e.g. the members of one sequence- or tensor-parallel
    group) receive the same slice and must return the same outputs and metrics.
    """

    rank: int
    """This rank's data-parallel index, ``0 .. size - 1``: it gets slice ``rank`` of
    ``Batch.split(size)``."""
    size: int
    """Number of data-parallel slices the role's batches are split into."""


@dataclass(kw_only=True, slots=True)
class LossContext:
    """What the engine tells ``loss_fn`` about the step, so a loss's result does not depend
    on how the batch was split into micro-batches or across data-parallel ranks."""

    global_tokens: int
    """Number of ``loss_mask`` tokens in the whole step, summed over all data-parallel ranks
    (each rank's slice counted once, not per sequence/tensor-parallel peer)."""
    global_sequences: int
    """Number of sequences in the whole step, summed over all data-parallel ranks."""
    dp_size: int = 1
    """Number of data-parallel ranks the step is split over (``DataParallelCoordinates.size``);
    for losses that average per rank first (1 on one rank)."""
    micro_batch_index: int = 0
    """Index of this micro-batch on this rank (``0 .. num_micro_batches - 1``)."""
    num_micro_batches: int = 1
    """Number of micro-batches this rank runs in this call (the same on every rank of
    backends that keep collectives in step, e.g. FSDP)."""


LossFn: TypeAlias = Callable[[dict[str, torch.Tensor], "Batch", LossContext], tuple[torch.Tensor, dict[str, float]]]
"""``loss_fn(outputs, micro_batch, ctx) -> (loss, metrics)``.

``outputs`` holds per-token tensors ``[b, T]`` for the micro-batch (``log_probs`` always;
``entropy`` and ``sum_pi_squared`` when asked for, see :data:`NEED_SUM_PI_SQUARED`;
``values`` for value models), aligned to its ``input_ids``;
``micro_batch``'s tensors are on the same device as ``outputs`` (the engine moves them there
before calling the loss).
``loss`` is this micro-batch's *share* of the global loss (e.g. a token sum divided by
``ctx.global_tokens``): the engine arranges for the gradient to equal the gradient of the
sum of all shares over micro-batches and data-parallel ranks. ``metrics`` are shares in
the same sense: the engine sums them over its micro-batches, the core over the
data-parallel ranks (:mod:`geartrain.cluster.reduce`), so a token-mean metric divided by
``ctx.global_tokens`` ends up as the global mean.
"""


@dataclass(kw_only=True, slots=True)
class StepOutput:
    """Result of ``forward_backward``."""

    outputs: dict[str, torch.Tensor]
    """Per-token tensors ``[B, T]`` (``log_probs``; ``entropy`` and ``sum_pi_squared`` when
    asked for; ``values`` for value models) for the batch the caller passed in, in its original order, on CPU, aligned
    to its ``input_ids`` (see the module docstring)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What the backend returns: the loss function's metrics summed over *this rank's*
    micro-batches, plus its own counts of this rank's slice (at least ``tokens``, the real
    tokens of the slice; the FSDP engine adds ``sequences`` and ``micro_batches``). The core
    then sums every key over the data-parallel ranks (:mod:`geartrain.cluster.reduce`), so
    what :meth:`geartrain.Engine.forward_backward` returns, and the trainer logs, is global
    and the same on every rank. An engine never reduces metrics itself."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Plain CPU tensors travel as numpy arrays (:mod:`geartrain.tensor_pickle`)."""
        if not plain_cpu(self.outputs):
            return (_step_output, (self.outputs, self.metrics))
        return (_step_output_from_arrays, (tensors_to_arrays(self.outputs), self.metrics))


def _step_output(outputs: dict[str, torch.Tensor], metrics: dict[str, float]) -> StepOutput:
    return StepOutput(outputs=outputs, metrics=metrics)


def _step_output_from_arrays(arrays: dict[str, tuple[Any, str]], metrics: dict[str, float]) -> StepOutput:
    return StepOutput(outputs=arrays_to_tensors(arrays), metrics=metrics)


@dataclass(kw_only=True, slots=True)
class SyncStats:
    """What one weight synchronisation moved (``reshard_for_rollout``), measured on the
    rank that returns it."""

    seconds: float
    """Wall time of the whole sync (gathers, casts and the rollout's ``update_weights``)."""
    bytes: int
    """Bytes of the tensors handed to the rollout (in the rollout's dtype); 0 on ranks
    without a rollout replica."""
    num_tensors: int
    """Number of named tensors sent."""
    num_buckets: int
    """Number of buckets the stream was cut into (each at most ``rollout.bucket_bytes``,
    unless one tensor alone is larger)."""
    max_bucket_bytes: int = 0
    """Size of the largest bucket: the peak extra memory of the sync."""


@runtime_checkable
class WeightReceiver(Protocol):
    """What ``reshard_for_rollout`` streams weights into (the core's
    :class:`~geartrain.rollout.Rollout` is one). :func:`geartrain.weights.send_weights`
    streams into it as the contract asks."""

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the tensors must arrive in (the rollout's compute dtype)."""
        ...

    @property
    def bucket_bytes(self) -> int:
        """The most bytes of tensors the sender may gather at once (``rollout.weight_bucket_bytes``)."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume ``(transformers name, full tensor)`` pairs as they come."""
        ...


@runtime_checkable
class AdapterReceiver(Protocol):
    """A receiver that also takes LoRA adapters (the core's :class:`~geartrain.rollout.Rollout`
    over a backend that declares ``lora``). An engine training LoRA adapters with
    ``lora.sync = "adapter"`` hands it the adapters instead of the merged weights."""

    @property
    def accepts_adapters(self) -> bool:
        """Whether ``update_adapter`` works here (the backend declares ``lora``)."""
        ...

    def update_adapter(self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        """Serve adapter ``name`` (replacing one of that name) on top of the base weights;
        ``tensors`` and ``config`` as a PEFT adapter directory holds them (see the
        ``update_adapter`` hook)."""
        ...


@dataclass(kw_only=True, slots=True)
class MemoryStats:
    """Memory around an offload/onload or release/resume, in bytes.

    ``before``/``after`` are what the backend measured (device memory on GPU, the process's
    resident set on CPU); ``freed`` is positive when memory was released.
    """

    before: int
    """Bytes in use before the move."""
    after: int
    """Bytes in use after it."""
    seconds: float
    """Wall time of the move."""
    detail: dict[str, int] = field(default_factory=dict)
    """Optional break-down by what moved (``params``, ``grads``, ``optimizer``, ``kv_cache``...)."""

    @property
    def freed(self) -> int:
        return self.before - self.after


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How a rollout samples. ``n`` samples per prompt are returned prompt-major:
    sample ``j`` of prompt ``i`` is row ``i * n + j``."""

    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """Softmax temperature; ``0`` means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p``
    (``1.0`` disables it). Applied after temperature and top-k: the nucleus is taken over
    the temperature-scaled, top-k-filtered distribution (as vLLM does)."""
    top_k: int = -1
    """``-1`` or ``0`` disables top-k."""
    max_tokens: int = 16
    """Most response tokens per sample (a sample that reaches it finishes with ``length``)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation of a sample stops after it emits any of these (the stop token is kept)."""
    stop_sequences: list[list[int]] = field(default_factory=list)
    """Token-id sequences that also stop a sample: generation stops right after the sample's
    last tokens equal one of them (the sequence is kept, nothing after it is returned, and
    ``finish_reason`` is ``"stop"``). Only tokens generated in *this* call are matched, never
    the prompt. A multi-turn agent's turn ends on its tool-call closer this way. A backend
    that cannot stop on a multi-token sequence natively generates on and cuts the sample
    after the first match (:func:`geartrain.layout.cut_at_stop`): the returned tokens and
    log-probs are the same."""
    max_tokens_per_prompt: list[int] | None = None
    """A response budget per prompt (``len(prompts)`` entries, each ``>= 1``), replacing
    ``max_tokens`` for that prompt's samples: a multi-turn episode's next turn may only use
    what is left of the episode's token budget. ``None``: ``max_tokens`` for every prompt."""
    repetition_penalty: float = 1.0
    """Penalty on tokens already in the prompt or the response (vLLM's / HF's: logits of
    those tokens divided by it when positive, multiplied when negative); ``1.0``: off. Only
    rollouts that declare the ``repetition_penalty`` capability take another value."""
    min_p: float = 0.0
    """Drop tokens whose probability is below ``min_p`` times the most likely token's;
    ``0.0``: off. Only rollouts that declare the ``min_p`` capability take another value."""
    seed: int | None = None
    """With a seed, the same prompts, weights and settings give the same samples: sample
    ``j`` of prompt ``i`` draws from its own stream seeded with
    ``geartrain.seeding.sample_seed(seed, prompt_indices[i], j)``, whatever else is in the
    call, so a job samples the same tokens on one rank or split across N. ``None``: unseeded,
    every call samples afresh (the torch rollout draws a random base seed), so two calls
    with the same inputs differ."""
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
    REPETITION_PENALTY = "repetition_penalty"
    MIN_P = "min_p"
    SUM_PI_SQUARED = "sum_pi_squared"
    """An engine that returns ``sum_pi_squared`` when ``batch.info[NEED_SUM_PI_SQUARED]``
    asks for it (the optimal token baseline needs it)."""


NEED_SUM_PI_SQUARED = "need_sum_pi_squared"
"""``batch.info`` key: when true, ``forward_backward`` of an engine that declares
``sum_pi_squared`` also returns (and passes to ``loss_fn``) the per-token output
``sum_pi_squared`` ``[B, T]``: ``Σ_v π(v | x_<t)²`` over the whole vocabulary of the
distribution that ``log_probs`` is taken from (fp32, aligned like ``log_probs``, 0 where
``log_probs`` is undefined, no gradient). Like the log-probs it is computed chunk by chunk
(over tokens, or over vocabulary shards on tensor-parallel engines): no micro-batch ever
holds a full-vocabulary tensor for it."""


ADAPTERS_OFF = "adapters_off"
"""``batch.info`` key: when true, an engine that trains LoRA adapters runs ``forward_backward``
on the base model with its adapters disabled (the reference policy without a second copy of
the weights). Engines without adapters ignore it."""


OFFLOAD_KINDS: frozenset[str] = frozenset({"params", "grads", "optimizer"})
"""What an engine's ``offload`` hook may be asked to move (the core refuses anything else
before the hook runs)."""
