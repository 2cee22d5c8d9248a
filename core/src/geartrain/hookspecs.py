"""The contract between geartrain's core and its backends: pluggy hook specifications.

Every hook below is ``firstresult``: the core builds one :class:`pluggy.PluginManager` per
engine or rollout *instance* and registers exactly one backend in it (plus the extensions
the user enabled, which may wrap any hook with ``@hookimpl(wrapper=True)``). So each call
runs in exactly one backend, never chosen by registration order.

A backend implements hooks as module-level functions (or methods of an object) decorated
with :data:`hookimpl`. An implementation may accept fewer arguments than the spec names,
never other ones; pluggy rejects unknown argument names at registration.

Calls are SPMD: in a worker group of N ranks, the core calls the same hook on every rank of
the role with the same arguments (except the batch, which is each rank's data-parallel
slice), so backends may use collectives inside any hook unless the hook says otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pluggy
import torch

from geartrain.types import (
    DataParallelCoordinates,
    EngineContext,
    EngineModel,
    LossFn,
    MemoryStats,
    RolloutEngine,
    SamplingParams,
    StepOutput,
    SyncStats,
    WeightReceiver,
)

if TYPE_CHECKING:
    from pydantic import BaseModel

    from geartrain.batch import Batch
    from geartrain.config import EngineConfig, ModelConfig, RolloutConfig

PROJECT_NAME = "geartrain"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

#: Hooks an engine backend must implement; the loader refuses one that lacks any of them.
REQUIRED_ENGINE_HOOKS: tuple[str, ...] = (
    "build_model",
    "shard",
    "forward_backward",
    "optimizer_step",
    "reshard_for_rollout",
    "save_checkpoint",
    "load_checkpoint",
)
#: Hooks a rollout backend must implement.
REQUIRED_ROLLOUT_HOOKS: tuple[str, ...] = (
    "build_rollout",
    "generate",
    "update_weights",
    "release",
    "resume",
)


# --------------------------------------------------------------------------- any plugin


@hookspec(firstresult=True)
def capabilities() -> Iterable[str]:  # type: ignore[empty-body]
    """Declare what this backend can do, as names from :class:`geartrain.types.Capability`
    (``cpu``, ``cuda``, ``sequence_parallel``, ``offload``...).

    Called once when the plugin is loaded, on the driver, before anything is built; it must
    be cheap and import nothing heavy. The core refuses a configuration that asks for a
    capability the backend does not declare (e.g. ``sp_size=2`` on an engine without
    ``sequence_parallel``) before any worker starts. Optional; no declaration means none.
    """


@hookspec(firstresult=True)
def config_schema() -> type[BaseModel]:  # type: ignore[empty-body]
    """Return the pydantic model of this backend's own options section
    (``[actor.engine.options]`` for an engine, ``[rollout.options]`` for a rollout).

    The core validates the user's section against it when the configuration is loaded,
    reporting every problem with its full path, and passes the validated model to the
    backend as ``config.options``. Optional; without it the section must be empty.
    """


# --------------------------------------------------------------------------- engine hooks


@hookspec(firstresult=True)
def build_model(config: ModelConfig, ctx: EngineContext) -> torch.nn.Module:  # type: ignore[empty-body]
    """Build the module for ``ctx.role``: a causal LM, or a value model when
    ``config.value_head`` is true (per-token scalar output).

    Called on every rank of the role, once. The module must hold the weights
    ``config`` describes (a hub id / local path, or a random init from
    ``config.seed`` for tiny models); :func:`geartrain.modeling.build_hf_model` does that
    for transformers models. Large models may be built on the meta device and filled in
    ``shard``. Must not apply parallelism (that is ``shard``'s job).
    """


@hookspec(firstresult=True)
def shard(module: torch.nn.Module, config: EngineConfig, model_config: ModelConfig, ctx: EngineContext) -> EngineModel:
    """Apply the backend's parallelism to ``module`` and create its optimizer and LR
    scheduler from ``config.optim``; return the backend's handle.

    ``model_config`` is the :class:`~geartrain.config.ModelConfig` that ``build_model``
    built ``module`` from: ``model_config.value_head`` tells a value model (critic, reward
    model: per-token ``values``) from a causal LM (``log_probs``), and ``dtype``/``path``
    are there for backends that need them. ``config.options`` is the backend's own options
    model, already validated (``config_schema``).

    Called on every rank once, right after ``build_model``. Collectives go over
    ``ctx.process_group``. The handle is opaque to the core: it is only ever passed back into
    this backend's hooks. Roles that never train (reference, reward) get
    ``config.optim.lr == 0`` and the backend may skip the optimizer. A bad option or an
    impossible combination raises :class:`geartrain.ConfigError` naming the key.
    """


@hookspec(firstresult=True)
def data_parallel_coordinates(model: EngineModel) -> DataParallelCoordinates:  # type: ignore[empty-body]
    """Say which data-parallel slice of a batch this rank consumes.

    Called on every rank after ``shard``. Optional: without it each rank is its own
    data-parallel rank (``rank``/``world_size`` from the context).
    """


@hookspec(firstresult=True)
def forward_backward(  # type: ignore[empty-body]
    model: EngineModel, batch: Batch, loss_fn: LossFn | None, forward_only: bool
) -> StepOutput:
    """The one compute primitive: forward (and backward) over this rank's slice of a batch.

    ``batch`` holds at least ``input_ids``, ``attention_mask`` and, when ``loss_fn`` is
    given, ``loss_mask`` (all ``[B, T]``; see :mod:`geartrain.types` for the layout). The
    backend owns micro-batching (``config.max_tokens_per_micro_batch``), padding removal /
    packing, sequence-parallel pre/post-processing and, on pipeline backends, the schedule.

    For each micro-batch it calls ``loss_fn(outputs, micro_batch, loss_ctx)`` with per-token
    ``log_probs`` (and ``entropy`` when ``batch.info["need_entropy"]`` is true,
    ``sum_pi_squared`` when ``batch.info["need_sum_pi_squared"]`` is true on an engine that
    declares ``sum_pi_squared`` (:data:`geartrain.types.NEED_SUM_PI_SQUARED`), ``values``
    for value models) and backpropagates the returned share of the loss, accumulating
    gradients; the step itself is ``optimizer_step``. ``loss_ctx`` carries the global token
    and sequence counts over all data-parallel ranks.

    With ``forward_only=True`` it computes outputs under ``no_grad`` and calls ``loss_fn``
    only if given (for metrics). Returns per-token outputs ``[B, T]`` on CPU in the order of
    ``batch``; on pipeline-parallel backends every rank returns the same outputs.

    An engine that declares ``lora`` and trains adapters (``config.lora``) runs the base
    model with its adapters disabled when ``batch.info["adapters_off"]``
    (:data:`geartrain.types.ADAPTERS_OFF`) is true: the reference policy's log-probs.
    """


@hookspec(firstresult=True)
def optimizer_step(model: EngineModel) -> dict[str, float]:  # type: ignore[empty-body]
    """Clip gradients to ``config.optim.clip_grad``, step the optimizer and LR scheduler,
    zero the gradients.

    If the gradient norm is not finite, skip the update (still zero the gradients and
    advance nothing) and report ``skipped = 1.0``. Returns at least ``grad_norm`` (before
    clipping), ``lr`` (the learning rate *this* step's update used) and ``skipped``.
    ``clip_grad = 0`` means no clipping. :func:`geartrain.optim.clipped_step` does all of
    this; the schedule's formula is in :mod:`geartrain.optim`. Collective: called on every
    rank.
    """


@hookspec(firstresult=True)
def reshard_for_rollout(model: EngineModel, rollout: WeightReceiver | None) -> SyncStats:  # type: ignore[empty-body]
    """Stream the current weights into ``rollout.update_weights``.

    With LoRA adapters (``config.lora``): ``lora.sync = "merged"`` streams base + BA under
    the transformers names; ``"adapter"`` calls ``rollout.update_adapter`` with the adapter
    tensors only (a :class:`~geartrain.types.AdapterReceiver`; the base goes through
    ``update_weights`` on the first sync only), falling back to merged for a receiver that
    takes no adapters. ``SyncStats.bytes`` counts what was handed over either way.

    Tensors are full (unsharded), named as the transformers checkpoint names them, in the
    rollout's dtype (``rollout.dtype``), and are passed as an iterator that yields them
    bucket by bucket (at most ``rollout.bucket_bytes`` gathered at once), so peak extra
    memory is bounded by the bucket size, not the model size. Called on every rank (the
    gathers are collectives); ranks that hold no rollout replica get ``rollout=None``.
    :func:`geartrain.weights.send_weights` implements it from ``(name, tensor)`` pairs.
    """


@hookspec(firstresult=True)
def save_checkpoint(model: EngineModel, path: Path, extra: dict[str, Any]) -> None:
    """Write model, optimizer, LR scheduler and RNG state plus the picklable ``extra``
    dict into the directory ``path`` (sharded where the backend shards).

    Called on every rank. The core makes the save atomic: it passes a temporary directory
    and publishes it (rename + completion marker) only after every rank returned, so the
    backend just writes into ``path``.
    """


@hookspec(firstresult=True)
def load_checkpoint(model: EngineModel, path: Path) -> dict[str, Any]:  # type: ignore[empty-body]
    """Restore what ``save_checkpoint`` wrote into ``model`` (in place) and return the
    ``extra`` dict. After loading, the next step is identical to the one an uninterrupted
    run would take. Called on every rank."""


@hookspec(firstresult=True)
def export_hf(model: EngineModel, path: Path, tokenizer: Any | None) -> None:
    """Write a plain Hugging Face directory (``config.json``, ``*.safetensors`` and the
    tokenizer if given) that ``transformers.AutoModelForCausalLM.from_pretrained`` and vLLM
    load. Called on every rank; rank 0 of the role's group (``ctx.rank == 0``, not the
    global rank) writes, after gathering, and every rank returns once the directory is
    complete."""


@hookspec(firstresult=True)
def offload(model: EngineModel, what: frozenset[str]) -> MemoryStats:  # type: ignore[empty-body]
    """Move ``what`` (a subset of ``{"params", "grads", "optimizer"}``) off the
    accelerator so another phase (rollout) can use the memory; measure before/after.
    Optional: requires the ``offload`` capability."""


@hookspec(firstresult=True)
def onload(model: EngineModel) -> MemoryStats:  # type: ignore[empty-body]
    """Bring back everything ``offload`` moved; afterwards training continues exactly as
    if nothing had moved. Optional: requires the ``offload`` capability."""


# --------------------------------------------------------------------------- rollout hooks


@hookspec(firstresult=True)
def build_rollout(config: RolloutConfig, model: ModelConfig, ctx: EngineContext) -> RolloutEngine:
    """Start an inference engine for ``model`` with ``config``'s limits (max length,
    KV-cache budget, dtype, tensor-parallel size); return the backend's handle.

    The rollout may start from the weights ``model`` describes; the trainer always calls
    ``update_weights`` with the trainer's weights before the first ``generate``.
    """


@hookspec(firstresult=True)
def generate(rollout: RolloutEngine, prompts: list[list[int]], sampling: SamplingParams) -> Batch:  # type: ignore[empty-body]
    """Sample ``sampling.n`` responses for each prompt (token ids in, token ids out).

    Returns a :class:`~geartrain.batch.Batch` of ``len(prompts) * n`` rows, prompt-major,
    with ``input_ids``/``attention_mask`` ``[B, T]`` (left-padded prompt then right-padded
    response), ``response_mask`` ``[B, T]`` and ``rollout_log_probs`` ``[B, T]`` (the
    log-prob of each sampled token under the sampling distribution *before* temperature,
    top-p and top-k, i.e. the model's own distribution), and ``info["prompt_length"]``,
    the padded prompt width. Per-sample meta ``prompt_index`` (the index of the row's prompt
    in *this call's* ``prompts``, ``0 .. len(prompts) - 1``, whatever
    ``sampling.prompt_indices`` says: the core maps it to the step's index) and
    ``finish_reason`` (``"stop"`` or ``"length"``). Never called while released (the core
    calls ``resume`` first); a backend may refuse such a call. :func:`geartrain.layout.rollout_batch` builds this batch;
    :func:`geartrain.layout.check_generate_inputs` refuses bad prompts and settings first.
    """


@hookspec(firstresult=True)
def update_weights(rollout: RolloutEngine, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load the (transformers-named, full) tensors into the engine, consuming the iterator
    as it goes (do not collect it into a list); reset caches that could return stale
    results (prefix cache). Tensors not named keep their values. Never called while
    released (the core calls ``resume`` first); a backend may refuse such a call."""


@hookspec(firstresult=True)
def update_adapter(rollout: RolloutEngine, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Serve the LoRA adapter ``name`` on top of the base weights for every later
    ``generate`` (an adapter of the same name is replaced; one adapter is active at a time).

    ``tensors`` are named as in a PEFT adapter file (``adapter_model.safetensors``:
    ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``.lora_B.weight``
    ``[out, r]``, ``<module>`` the transformers module path), in the rollout's dtype;
    ``config`` is the PEFT ``adapter_config.json`` as a dict (``r``, ``lora_alpha``,
    ``target_modules``, ``use_rslora``...). Each adapted linear layer then computes
    ``W x + (lora_alpha / r) B A x`` (``sqrt(r)`` in place of ``r`` with ``use_rslora``).
    The base weights are those of ``update_weights`` and stay as they are. The adapter
    must survive ``release``/``resume``. Optional: a backend that implements it declares
    the ``lora`` capability (and is built with ``RolloutConfig.max_lora_rank``)."""


@hookspec(firstresult=True)
def release(rollout: RolloutEngine) -> MemoryStats:  # type: ignore[empty-body]
    """Free the engine's memory (weights and KV cache) for the training phase; measure it.
    After ``resume``, generation continues with the weights it had."""


@hookspec(firstresult=True)
def resume(rollout: RolloutEngine) -> MemoryStats:  # type: ignore[empty-body]
    """Re-acquire what ``release`` freed, with the weights the engine had before, and
    measure it. After ``resume`` the same prompts, seed and settings give the same samples as
    before ``release``. Calling it when nothing is released does nothing."""


@hookspec(firstresult=True)
def shutdown(rollout: RolloutEngine) -> None:
    """Stop the engine for good and free everything it holds (weights, KV cache, worker
    processes); the handle is unusable afterwards. Called once, at the end of a run. Optional:
    without it the handle is simply dropped."""
