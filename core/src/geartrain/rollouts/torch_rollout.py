"""The reference rollout: batched sampling over a plain transformers causal LM.

It is the embedded default (``rollout.backend = "torch"``) and the yardstick the other
rollouts are compared with, so it favours exactness over speed:

* the sampling loop is written out here (no ``model.generate``) over a ``DynamicCache``;
  left-padded prompts get ``position_ids`` that start at 0 on each row's first real token;
* ``rollout_log_probs`` are ``log_softmax`` of the *unscaled* logits (the model's own
  distribution, as vLLM reports by default), whatever temperature / top-p / top-k sampled;
* every sample draws its random numbers from its own counter-based stream
  (:func:`geartrain.seeding.uniforms`: its ``t``-th token uses the ``t``-th number of the
  stream of :func:`geartrain.seeding.sample_seed` of (seed, prompt index in the step,
  sample index)), computed for all rows at once, so a seed gives the same samples however
  the rows are chunked or split across ranks, on any device;
* the samples of one prompt share its prefill (one forward per distinct prompt, the KV
  cache copied to each sample);
* rows are decoded in chunks of at most ``max_batch_size`` (default: the config's
  ``max_num_seqs``), fewer when ``kv_cache_bytes`` cannot hold that many full-length rows;
* finished rows leave the batch (and the KV cache), so a long tail costs only its rows;
* ``stop_sequences`` are matched natively, per row, on the tokens generated in this call
  (a row stops right after its last tokens equal one), and ``max_tokens_per_prompt`` gives
  each prompt's rows their own budget: a multi-turn agent's turn is one such call.

``release`` writes the weights to a safetensors file and empties every parameter, which on
CPU returns their memory to the operating system; ``resume`` reads them back.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from geartrain.batch import Batch
from geartrain.config import ModelConfig, RolloutConfig, options_of
from geartrain.errors import ConfigError, GeartrainError
from geartrain.hookspecs import hookimpl
from geartrain.layout import READY_AT, check_generate_inputs, max_tokens_of, rollout_batch
from geartrain.lora_hooks import LoraHooks
from geartrain.memory import collect_garbage, current_memory_bytes, tensor_bytes
from geartrain.modeling import build_hf_model, torch_dtype
from geartrain.rollouts.decode_record import DecodeRecord, last_logits_only, prefill_rows
from geartrain.rollouts.sampler import sample_tokens
from geartrain.seeding import prompt_indices, sample_seed
from geartrain.types import Capability, EngineContext, MemoryStats, SamplingParams


class TorchRolloutOptions(BaseModel):
    """``[rollout.options]`` of the torch rollout."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int | None = Field(None, ge=1)
    """Rows (prompts x samples) decoded together in one chunk; default: the rollout
    config's ``max_num_seqs``."""
    offload_dir: str | None = None
    """Directory ``release`` writes the weights into; default: the system temp directory."""
    static_cache: bool | None = None
    """Decode with a static KV cache and fixed shapes, the decode step captured in CUDA
    graphs on CUDA (:mod:`geartrain.rollouts.static_decode`). Default: on for CUDA, off
    elsewhere (on a CPU the shrinking dynamic batch is faster)."""
    decode_graph: Literal["step", "forward", "none"] | None = None
    """What of a static-cache decode step is captured in CUDA graphs (CUDA only; see
    :mod:`geartrain.rollouts.static_decode`): ``"step"`` the whole step (forward, sampling,
    stop rules) as one graph, ``"forward"`` the model's forward only
    (``torch.compile(mode="reduce-overhead")``), ``"none"`` nothing. Default:
    ``"forward"``."""
    decode_attention: Literal["gqa", "hf"] = "gqa"
    """``"gqa"``: a model with grouped key/value heads that attends through ``sdpa`` decodes
    with :func:`geartrain.rollouts.gqa_attention.gqa_decode_attention` (the cache read
    without expanding it to every query head); ``"hf"``: transformers' own ``sdpa``."""
    kv_bucket_tokens: int = Field(128, ge=0)
    """Static-cache decode with the ``"gqa"`` attention: each step reads the cache's filled
    columns rounded up to a multiple of this many (one compiled / captured step per
    bucket), not its whole width. 0: the whole width every step."""
    compact_every: int = Field(0, ge=0)
    """Static-cache decode: every this many steps, when at most half of the chunk's rows
    are still live, decode on with those rows only (their KV cache copied to a smaller
    static cache; one host synchronisation per check). 0: off (finished rows stay in the
    batch until the chunk ends)."""
    simulated_token_s: float = Field(0.0, ge=0)
    """Benchmarks only: simulate generation time as if every sample decoded a heavy-tailed
    number of tokens at this many seconds each, in a continuous-batching engine: each
    sample finishes at its own time (a GRPO group at its longest sample's), reported per
    row as ``meta["ready_at"]``; ``Rollout.generate`` waits for the last one unless the
    caller streams (the separate rollout releases each group when it is ready). A weight
    update takes effect once the samples in flight finished. 0: off. The tokens returned
    are the real ones; only the time is simulated, so long-tail effects show on a small CPU."""
    simulated_tail_alpha: float = Field(1.2, gt=0)
    """Pareto shape of the simulated lengths (smaller: heavier tail); lengths are
    ``floor(U ** (-1 / alpha))`` tokens, ``U`` uniform from the sample's seed."""
    simulated_max_tokens: int = Field(256, ge=1)
    """Cap of a simulated length."""


@dataclass
class SimulatedClock:
    """The simulated engine's state (``time.time()`` values): when its last sample in
    flight finishes, and when its newest weights took effect."""

    last_finish: float = 0.0
    weights_at: float = 0.0


@dataclass(kw_only=True)
class TorchRolloutEngine:
    """The torch rollout's handle (opaque to the core)."""

    model: torch.nn.Module
    config: RolloutConfig
    options: TorchRolloutOptions
    device: torch.device
    dtype: torch.dtype
    pad_token_id: int
    released_to: Path | None = None
    """Where the weights are while released; ``None`` while they are in the model."""
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    """Every state-dict name (tied aliases included) -> the live parameter or buffer."""
    adapter: LoraHooks | None = None
    """The LoRA adapter served on top of the weights (``update_adapter``), if any."""
    clock: SimulatedClock = field(default_factory=lambda: SimulatedClock())
    """The simulated engine's time (``simulated_token_s > 0`` only)."""

    @property
    def released(self) -> bool:
        return self.released_to is not None


# --------------------------------------------------------------------------- plugin info


@hookimpl
def capabilities() -> list[str]:
    return [Capability.CPU, Capability.CUDA, Capability.RELEASE_MEMORY, Capability.LORA]


@hookimpl
def config_schema() -> type[BaseModel]:
    return TorchRolloutOptions


# --------------------------------------------------------------------------- lifecycle


@hookimpl
def build_rollout(config: RolloutConfig, model: ModelConfig, ctx: EngineContext) -> TorchRolloutEngine:
    if config.tensor_parallel_size != 1:
        raise ConfigError(
            [
                (
                    "tensor_parallel_size",
                    f"the torch rollout runs one model per rank, got {config.tensor_parallel_size} "
                    "(use the vllm or sglang rollout for tensor parallelism)",
                )
            ]
        )
    options = options_of(config, TorchRolloutOptions)
    device = torch.device(ctx.device, ctx.local_rank) if ctx.device != "cpu" else torch.device("cpu")
    dtype = torch_dtype(config.dtype)
    module = build_hf_model(model, device=device).to(dtype).eval()
    module.requires_grad_(False)
    if options.decode_attention == "gqa":
        from geartrain.rollouts.gqa_attention import use_gqa_decode

        use_gqa_decode(module)
    pad = module.config.pad_token_id
    engine = TorchRolloutEngine(
        model=module,
        config=config,
        options=options,
        device=device,
        dtype=dtype,
        pad_token_id=int(pad) if pad is not None else 0,
    )
    engine.params = _named_state(module)
    return engine


@hookimpl
def shutdown(rollout: TorchRolloutEngine) -> None:
    if rollout.released_to is not None:
        rollout.released_to.unlink(missing_ok=True)
        rollout.released_to = None
    rollout.params = {}
    if rollout.model is not None:
        from geartrain.rollouts.static_decode import drop_static_caches

        drop_static_caches(rollout.model)
    rollout.model = None  # type: ignore[assignment]
    collect_garbage(rollout.device.type)


def _named_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    # keep_vars: the live Parameters, so copying into them updates the model; tied weights
    # appear under both names and point at the same tensor.
    return dict(module.state_dict(keep_vars=True))


def _check_live(rollout: TorchRolloutEngine, action: str) -> None:
    if rollout.model is None:
        raise GeartrainError(f"torch rollout: cannot {action} after shutdown")
    if rollout.released:
        raise GeartrainError(f"torch rollout: cannot {action} while released; call resume() first")


# --------------------------------------------------------------------------- weights


@hookimpl
def update_weights(rollout: TorchRolloutEngine, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    _check_live(rollout, "update weights")
    with torch.no_grad():
        for name, tensor in named_tensors:
            target = rollout.params.get(name)
            if target is None:
                known = ", ".join(sorted(rollout.params)[:6])
                raise GeartrainError(
                    f"torch rollout: update_weights got unknown tensor '{name}'; the model's tensors are "
                    f"named like {known}, ... (transformers checkpoint names)"
                )
            if tuple(target.shape) != tuple(tensor.shape):
                raise GeartrainError(
                    f"torch rollout: update_weights got '{name}' of shape {tuple(tensor.shape)}, "
                    f"the model's is {tuple(target.shape)}"
                )
            target.copy_(tensor)
    if rollout.options.simulated_token_s > 0:
        simulated_weight_update(rollout)


@hookimpl
def update_adapter(
    rollout: TorchRolloutEngine, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]
) -> None:
    """The adapter runs as forward hooks on the adapted linear layers (``out + scale x
    B(A x)``, PEFT's own order of operations); the weights stay the base's."""
    _check_live(rollout, "update the adapter")
    if rollout.adapter is not None:
        rollout.adapter.remove()
        rollout.adapter = None
    rollout.adapter = LoraHooks.attach(
        rollout.model,
        tensors,
        config,
        device=rollout.device,
        dtype=rollout.dtype,
        max_rank=rollout.config.max_lora_rank,
        name=name,
    )


@hookimpl
def release(rollout: TorchRolloutEngine) -> MemoryStats:
    _check_live(rollout, "release")
    from safetensors.torch import save_file

    kind = rollout.device.type
    start = time.perf_counter()
    collect_garbage(kind)
    before = current_memory_bytes(kind)
    from geartrain.rollouts.static_decode import drop_static_caches

    drop_static_caches(rollout.model)  # the decode's KV buffers go with the weights
    unique = _unique_tensors(rollout.params)
    weight_bytes = tensor_bytes(unique.values())
    directory = rollout.options.offload_dir or tempfile.gettempdir()
    fd, name = tempfile.mkstemp(prefix="geartrain-torch-rollout-", suffix=".safetensors", dir=directory)
    os.close(fd)
    path = Path(name)
    save_file({k: v.detach().cpu().contiguous() for k, v in unique.items()}, str(path))
    for tensor in unique.values():
        # Replace the storage, not the Parameter: the module and the name map keep their objects.
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    rollout.released_to = path
    collect_garbage(kind)
    _trim_heap()
    after = current_memory_bytes(kind)
    return MemoryStats(
        before=before,
        after=after,
        seconds=time.perf_counter() - start,
        detail={"weight_bytes": weight_bytes, "num_tensors": len(unique)},
    )


@hookimpl
def resume(rollout: TorchRolloutEngine) -> MemoryStats:
    if rollout.model is None:
        raise GeartrainError("torch rollout: cannot resume after shutdown")
    kind = rollout.device.type
    start = time.perf_counter()
    before = current_memory_bytes(kind)
    path = rollout.released_to
    if path is None:  # not released: nothing to do
        return MemoryStats(before=before, after=before, seconds=0.0)
    from safetensors.torch import load_file

    # load_file maps the file; clone so the weights live in memory, not in a deleted file.
    saved = load_file(str(path), device=str(rollout.device))
    unique = _unique_tensors(rollout.params)
    for name, tensor in unique.items():
        tensor.data = saved.pop(name).clone()
    del saved
    path.unlink(missing_ok=True)
    rollout.released_to = None
    after = current_memory_bytes(kind)
    return MemoryStats(
        before=before,
        after=after,
        seconds=time.perf_counter() - start,
        detail={"weight_bytes": tensor_bytes(unique.values())},
    )


def _unique_tensors(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One name per distinct tensor object (tied weights once)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in params.items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    return out


def _trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc keeps them otherwise), so the measured
    resident set reflects the release."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# --------------------------------------------------------------------------- generation


@hookimpl
def generate(rollout: TorchRolloutEngine, prompts: list[list[int]], sampling: SamplingParams) -> Batch:
    _check_live(rollout, "generate")
    check_generate_inputs(
        "torch",
        prompts,
        sampling,
        max_model_len=rollout.config.max_model_len,
        vocab_size=rollout.model.config.vocab_size,
    )
    if not prompts:
        return rollout_batch([], [], [], prompt_index=[], finish_reason=[], pad_token_id=rollout.pad_token_id)
    n = sampling.n
    rows = [(i, j) for i in range(len(prompts)) for j in range(n)]  # prompt-major
    # Without a seed, fresh OS entropy: drawing from torch's global RNG would shift the
    # trainer's random stream.
    base_seed = sampling.seed if sampling.seed is not None else secrets.randbits(62)
    global_index = prompt_indices(sampling.prompt_indices, len(prompts))
    budgets = max_tokens_of(sampling, len(prompts))
    chunk = chunk_rows(rollout, prompts, sampling)
    responses: list[list[int]] = []
    log_probs: list[list[float]] = []
    reasons: list[str] = []
    ready_at = (
        simulated_finish_times(rollout, [sample_seed(base_seed, global_index[i], j) for i, j in rows])
        if rollout.options.simulated_token_s > 0
        else None
    )
    for start in range(0, len(rows), chunk):
        part = rows[start : start + chunk]
        out = _decode_chunk(
            rollout,
            [prompts[i] for i, _ in part],
            [sample_seed(base_seed, global_index[i], j) for i, j in part],
            sampling,
            prompt_ids=[i for i, _ in part],
            budgets=[budgets[i] for i, _ in part],
        )
        for toks, lps, reason in out:
            responses.append(toks)
            log_probs.append(lps)
            reasons.append(reason)
    batch = rollout_batch(
        [prompts[i] for i, _ in rows],
        responses,
        log_probs,
        prompt_index=[i for i, _ in rows],
        finish_reason=reasons,
        pad_token_id=rollout.pad_token_id,
    )
    if ready_at is not None:
        batch.meta[READY_AT] = ready_at
    return batch


def simulated_lengths(options: TorchRolloutOptions, seeds: list[int]) -> list[int]:
    """Each sample's simulated length (see ``TorchRolloutOptions.simulated_token_s``): Pareto
    with shape ``simulated_tail_alpha`` from the sample's own seed, so a sample's length is
    the same whichever replica or batch generates it."""
    lengths = []
    for seed in seeds:
        u = float(torch.rand((), generator=torch.Generator().manual_seed(seed % (2**63)), dtype=torch.float64))
        lengths.append(min(options.simulated_max_tokens, int(max(u, 1e-12) ** (-1.0 / options.simulated_tail_alpha))))
    return lengths


def simulated_finish_times(rollout: TorchRolloutEngine, seeds: list[int]) -> list[float]:
    """When (``time.time()``) each sample of a call finishes decoding in the simulated
    engine: a continuous-batching engine admits a request at once, each of its samples
    decoding ``simulated_lengths`` tokens of ``simulated_token_s`` seconds, except that
    samples admitted after a weight update start when the update was applied (see
    :func:`simulated_weight_update`). Moves the engine's clock of samples in flight."""
    options, clock = rollout.options, rollout.clock
    start = max(time.time(), clock.weights_at)
    done = [start + options.simulated_token_s * n for n in simulated_lengths(options, seeds)]
    clock.last_finish = max([clock.last_finish, *done])
    return done


def simulated_weight_update(rollout: TorchRolloutEngine) -> None:
    """A weight update is applied between requests: once every sample in flight finished
    (no partial rollouts), so the new weights take effect at the engine's last finish."""
    rollout.clock.weights_at = max(time.time(), rollout.clock.last_finish)


def chunk_rows(rollout: TorchRolloutEngine, prompts: list[list[int]], sampling: SamplingParams) -> int:
    """How many rows one chunk decodes: ``max_batch_size`` (or ``max_num_seqs``), and no
    more than ``kv_cache_bytes`` holds at the longest sequence this call can produce."""
    rows = rollout.options.max_batch_size or rollout.config.max_num_seqs
    budget = rollout.config.kv_cache_bytes
    if budget is not None:
        cfg = rollout.model.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        longest = min(
            max(len(p) for p in prompts) + max(max_tokens_of(sampling, len(prompts))), rollout.config.max_model_len
        )
        per_row = 2 * cfg.num_hidden_layers * heads * head_dim * longest * rollout.dtype.itemsize
        rows = min(rows, max(1, budget // per_row))
    return rows


@torch.no_grad()
def _decode_chunk(
    rollout: TorchRolloutEngine,
    prompts: list[list[int]],
    seeds: list[int],
    sampling: SamplingParams,
    prompt_ids: list[int] | None = None,
    budgets: list[int] | None = None,
) -> list[tuple[list[int], list[float], str]]:
    """Decode one chunk of rows; returns (response tokens, their log-probs, finish reason).
    Row ``r`` generates at most ``budgets[r]`` tokens (default ``sampling.max_tokens``).

    Rows with the same ``prompt_ids`` entry (the samples of one prompt) share its prefill:
    each distinct prompt runs through the model once and its KV cache and first-token
    logits are copied to its rows."""
    from transformers import DynamicCache

    model, device = rollout.model, rollout.device
    b = len(prompts)
    keys = prompt_ids if prompt_ids is not None else list(range(b))
    static = rollout.options.static_cache
    if static or (static is None and device.type == "cuda"):
        from geartrain.rollouts.static_decode import decode_chunk_static

        wanted = budgets if budgets is not None else [sampling.max_tokens] * b
        limits = [min(w, rollout.config.max_model_len - len(p)) for w, p in zip(wanted, prompts, strict=True)]
        return decode_chunk_static(
            model,
            device,
            prompts,
            seeds,
            sampling,
            prompt_ids=keys,
            budgets=limits,
            pad_token_id=rollout.pad_token_id,
            mode=rollout.options.decode_graph,
            kv_bucket_tokens=rollout.options.kv_bucket_tokens,
            compact_every=rollout.options.compact_every,
        )
    unique, expand, input_ids, mask, positions = prefill_rows(prompts, keys, rollout.pad_token_id, device)
    wanted = budgets if budgets is not None else [sampling.max_tokens] * b
    budget = [min(w, rollout.config.max_model_len - len(p)) for w, p in zip(wanted, prompts, strict=True)]
    record = DecodeRecord(budget, sampling.stop_token_ids, sampling.stop_sequences, device)
    steps = record.steps
    row_seeds = torch.tensor(seeds, dtype=torch.int64)
    active = torch.arange(b)  # original row of each live batch row
    cache = DynamicCache(config=model.config)
    step_ids, step_pos = input_ids, positions
    last_only = last_logits_only(model)
    for t in range(steps):
        out = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=step_pos,
            past_key_values=cache,
            use_cache=True,
            **last_only,
        )
        logits = out.logits[:, -1, :].float()
        cache = out.past_key_values
        if t == 0:  # from one row per prompt to one row per sample
            if len(unique) < b:
                logits = logits.index_select(0, expand)
                cache.batch_select_indices(expand)
            mask, step_pos = mask.index_select(0, expand), step_pos.index_select(0, expand)
        raw_lp = torch.log_softmax(logits, dim=-1)
        new = sample_tokens(logits, sampling, row_seeds[active], t)
        new_lp = raw_lp.gather(-1, new.unsqueeze(-1)).squeeze(-1)
        keep = record.add(active, t, new, new_lp)
        if not bool(keep.any()):
            break
        if not bool(keep.all()):
            index = keep.nonzero().squeeze(1)
            on_device = index.to(device)
            cache.batch_select_indices(on_device)
            mask, new, step_pos = mask[on_device], new[on_device], step_pos[on_device]
            active = active[index]
        mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=-1)
        step_ids = new.unsqueeze(-1)
        step_pos = step_pos[:, -1:] + 1
    return record.results()
