"""The torch rollout's fixed-shape decode loop: a static KV cache and, on CUDA, CUDA graphs.

The dynamic loop of :mod:`geartrain.rollouts.torch_rollout` grows its cache by one column
per step and drops finished rows, so every step has new shapes: right for a CPU, where
each kernel is long, and wrong for a GPU, where a 0.5B model's decode step is hundreds of
tiny kernel launches. Here every decode step has the same shapes and addresses:

* the samples of a prompt share its prefill (one forward per distinct prompt into a
  dynamic cache), whose keys/values are then copied into a :class:`~transformers.StaticCache`
  of ``rows x (prompt width + steps)``;
* the attention mask, the fed tokens, their positions and the step counter are buffers
  updated in place; finished rows stay in the batch (their outputs are ignored);
* sampling (:func:`~geartrain.rollouts.fused_sampler.sample_with_log_prob`: the dynamic
  loop's draw, fused with the token's log-prob, so a seed gives the same tokens on either
  path; compiled on CUDA) and the stop rules
  (:class:`~geartrain.rollouts.decode_record.DeviceDecodeRecord`) run on the device with the
  step as a device tensor: nothing is read back to the host during the loop except, every
  step and without waiting for the GPU, whether every row is done.

How much is graph-captured is ``rollout.options.decode_graph`` (:data:`GraphMode`):

* ``"step"``: the whole decode step (forward, sampling, the record, the next step's
  inputs) is one CUDA graph, replayed once per token; the forward inside it compiled by
  ``torch.compile`` (kernel fusion, no graphs of its own). One step runs first on a side
  stream (warm-up and compilation), then the step is captured. If capture fails the call
  goes on without the graph and later calls use ``"forward"``, with a warning.
* ``"forward"``: only the model's forward, ``torch.compile(mode="reduce-overhead")`` (CUDA
  graphs through torch's cudagraph trees); sampling runs eagerly after it.
* ``"none"``: everything eager (the CPU, and how CI tests the logic of the others: the
  step function is the same Python on every path).
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

import torch

from geartrain.rollouts.decode_record import DeviceDecodeRecord, last_logits_only, prefill_rows
from geartrain.rollouts.fused_sampler import sample_with_log_prob
from geartrain.rollouts.gqa_attention import GQA_DECODE, KV_LEN, kv_bucket
from geartrain.types import SamplingParams

__all__ = ["GraphMode", "decode_chunk_static", "decode_step", "drop_static_caches", "graph_mode"]

GraphMode = Literal["step", "forward", "none"]

#: Steps the host may enqueue ahead of the GPU before it waits to learn whether every row
#: is done: enough to keep the GPU busy, few enough that an early finish wastes little.
STEPS_IN_FLIGHT = 4

_COMPILED: dict[tuple[int, str], Callable[..., Any]] = {}
_SAMPLER: dict[str, Callable[..., Any]] = {}
_STEP_GRAPH_FAILED: set[int] = set()


def graph_mode(requested: GraphMode | None, model: torch.nn.Module, device: torch.device) -> GraphMode:
    """The mode a call runs in: ``requested`` (default: ``"forward"`` on CUDA), ``"none"``
    off CUDA, and ``"forward"`` for a model whose step graph failed to capture before."""
    if device.type != "cuda":
        return "none"
    mode = requested or "forward"
    if mode == "step" and id(model) in _STEP_GRAPH_FAILED:
        return "forward"
    return mode


def decode_step(model: torch.nn.Module, device: torch.device, mode: GraphMode = "forward") -> Callable[..., Any]:
    """The forward used for decode steps: on CUDA ``model.forward`` compiled (``"forward"``:
    ``mode="reduce-overhead"``, CUDA graphs; ``"step"``: default mode, to be captured with
    the rest of the step), once per model object and mode, reused across calls; otherwise
    ``model.forward`` itself."""
    if device.type != "cuda" or mode == "none":
        return model.forward
    key = (id(model), mode)
    if key not in _COMPILED:
        if mode == "forward":
            _COMPILED[key] = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
        else:
            _COMPILED[key] = torch.compile(model.forward, fullgraph=False)
    return _COMPILED[key]


def sampler(device: torch.device, mode: GraphMode = "forward") -> Callable[..., Any]:
    """The token choice of a decode step: on CUDA (any mode but ``"none"``)
    :func:`~geartrain.rollouts.fused_sampler.sample_with_log_prob` compiled (its passes over
    the logits fused into few kernels), falling back to it uncompiled, with a warning, if
    compilation fails; otherwise the function itself. The fall-back is final for the
    process, also for a decode loop that already holds the returned function: a failed
    compile costs seconds, and retrying it at every token cost minutes (seen on torch 2.11,
    whose inductor could not generate the cumsum's scan)."""
    if device.type != "cuda" or mode == "none":
        return sample_with_log_prob
    if "cuda" not in _SAMPLER:
        current: list[Callable[..., Any]] = [torch.compile(sample_with_log_prob, dynamic=False)]

        def choose(*args: Any) -> Any:
            if current[0] is sample_with_log_prob:
                return sample_with_log_prob(*args)
            try:
                return current[0](*args)
            except Exception as exc:  # noqa: BLE001 - any compile failure falls back to eager
                warnings.warn(
                    f"torch rollout: the sampler could not be compiled ({exc}); sampling uncompiled",
                    stacklevel=2,
                )
                current[0] = _SAMPLER["cuda"] = sample_with_log_prob
                return sample_with_log_prob(*args)

        _SAMPLER["cuda"] = choose
    return _SAMPLER["cuda"]


_CACHES = "_geartrain_static_caches"


def drop_static_caches(model: torch.nn.Module) -> None:
    """Free the static caches kept on ``model`` (the rollout's release and shutdown)."""
    if hasattr(model, _CACHES):
        delattr(model, _CACHES)


def _static_cache_from(model: torch.nn.Module, dynamic: Any, rows: int, max_len: int) -> Any:
    """A StaticCache of ``rows x max_len`` holding ``dynamic``'s keys/values in its first
    columns (and counting them as seen). One cache per shape is kept on the model and reset
    for the next call: its buffers keep their addresses, so the compiled decode step (whose
    CUDA graphs read them) is reused instead of recompiled every call."""
    from transformers import StaticCache

    caches: dict[tuple[int, int], Any] = model.__dict__.setdefault(_CACHES, {})
    static = caches.get((rows, max_len))
    if static is None:
        static = caches[(rows, max_len)] = StaticCache(config=model.config, max_cache_len=max_len)
    else:
        static.reset()
    for layer, src in zip(static.layers, dynamic.layers, strict=True):
        layer.update(src.keys, src.values)  # allocates the buffers on first use, copies the prefill
    return static


class _StepState:
    """The buffers of one chunk's decode loop and the step that advances them. Every
    tensor keeps its address for the whole call (a captured step reads and writes them)."""

    def __init__(
        self,
        *,
        forward: Callable[..., Any],
        cache: Any,
        record: DeviceDecodeRecord,
        sampling: SamplingParams,
        seeds: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        width: int,
        pad_token_id: int,
        choose_fn: Callable[..., Any] = sample_with_log_prob,
    ) -> None:
        rows = len(seeds)
        self.choose_fn = choose_fn
        self.forward, self.cache, self.record, self.sampling = forward, cache, record, sampling
        self.seeds, self.mask, self.positions, self.width = seeds, mask, positions, width
        device = mask.device
        self.step_ids = torch.full((rows, 1), pad_token_id, dtype=torch.long, device=device)
        self.counter = torch.zeros((), dtype=torch.long, device=device)
        """The index of the token the next :meth:`choose` samples."""
        self.all_done = torch.zeros((), dtype=torch.bool, device=device)
        self.kv_len: int | None = None
        """Cache columns the next :meth:`advance` reads (None: all); set by the loop."""

    def choose(self, logits: torch.Tensor) -> None:
        """Sample token ``counter`` of every row from ``logits`` ``[rows, V]`` (any float
        dtype, read in fp32), record it, and make it the next step's input."""
        new, new_lp = self.choose_fn(logits, self.sampling, self.seeds, self.counter)
        self.record.add(self.counter, new, new_lp)
        self.step_ids.copy_(new.unsqueeze(-1))
        self.counter += 1
        self.all_done.copy_(self.record.done.all())

    def advance(self) -> None:
        """One decode step: feed the last sampled tokens, then :meth:`choose` the next."""
        fed = (self.width + self.counter - 1).view(1, 1).expand(len(self.seeds), 1)
        self.mask.scatter_(1, fed, 1)
        bounded = {KV_LEN: self.kv_len} if self.kv_len is not None else {}
        out = self.forward(
            input_ids=self.step_ids,
            attention_mask=self.mask,
            position_ids=self.positions,
            past_key_values=self.cache,
            use_cache=True,
            **bounded,
        )
        logits = out.logits[:, -1, :]  # the model's dtype: the sampler reads it in fp32
        self.positions += 1
        self.choose(logits)


class _DoneWatch:
    """Whether every row is done, learnt without stalling the GPU: on CUDA each step's flag
    is copied to pinned host memory behind an event, and the host waits only when
    :data:`STEPS_IN_FLIGHT` steps are enqueued; elsewhere the flag is read at once."""

    def __init__(
        self, flag: torch.Tensor, *, deferred: bool | None = None, event: Callable[[], Any] | None = None
    ) -> None:
        """``deferred`` (default: on CUDA) reads the flag through events made by ``event``
        (default ``torch.cuda.Event``; tests pass a stand-in)."""
        self.flag = flag
        self.deferred = flag.device.type == "cuda" if deferred is None else deferred
        if self.deferred:
            self.slots = torch.zeros(STEPS_IN_FLIGHT, dtype=torch.bool, pin_memory=flag.device.type == "cuda")
            self.event = event or torch.cuda.Event
            self.pending: deque[tuple[int, Any]] = deque()
            self.posted = 0

    def post(self) -> None:
        """Note the flag after the step just enqueued."""
        if self.deferred:
            slot = self.posted % STEPS_IN_FLIGHT
            self.slots[slot].copy_(self.flag, non_blocking=True)
            event = self.event()
            event.record()
            self.pending.append((slot, event))
            self.posted += 1

    def finished(self) -> bool:
        """True once some step's flag said every row is done."""
        if not self.deferred:
            return bool(self.flag)
        while self.pending and (len(self.pending) >= STEPS_IN_FLIGHT or self.pending[0][1].query()):
            slot, event = self.pending.popleft()
            event.synchronize()
            if bool(self.slots[slot]):
                return True
        return False


def _marking_steps(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` (cudagraph trees) told before each call that a new step begins: the
    last step's outputs, which the next replay overwrites, were consumed."""

    def forward(**inputs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(**inputs)

    return forward


def _capture(state: _StepState, pool: Any = None) -> torch.cuda.CUDAGraph | None:
    """Run one step on a side stream (warm-up: compilation, library handles), then capture
    the next as a CUDA graph (capturing runs nothing), in memory ``pool`` (an earlier
    graph's, shared) when given. ``None``, with a warning, when the step cannot be
    captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        state.advance()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        # thread_local: another thread's CUDA work (trainer.async_rollout trains while this
        # thread decodes) does not invalidate this capture
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            state.advance()
    except Exception as exc:  # noqa: BLE001 - any capture failure falls back to the uncaptured step
        warnings.warn(
            f"torch rollout: the decode step could not be captured in a CUDA graph ({exc}); "
            'decoding without it (rollout.options.decode_graph = "forward" from now on)',
            stacklevel=3,
        )
        return None
    return graph


def _compact(model: torch.nn.Module, state: _StepState, keep: torch.Tensor, filled: int, max_len: int) -> _StepState:
    """The step state of rows ``keep`` only: their ``filled`` cache columns copied into a
    static cache of ``len(keep)`` rows (kept on the model like the others), every per-row
    buffer and the record's rows picked, the step counter carried over."""
    from transformers import StaticCache

    caches: dict[tuple[int, int], Any] = model.__dict__.setdefault(_CACHES, {})
    rows = len(keep)
    static = caches.get((rows, max_len))
    if static is None:
        static = caches[(rows, max_len)] = StaticCache(config=model.config, max_cache_len=max_len)
    else:
        static.reset()
    for layer, src in zip(static.layers, state.cache.layers, strict=True):
        layer.update(src.keys[:, :, :filled].index_select(0, keep), src.values[:, :, :filled].index_select(0, keep))
    new = _StepState(
        forward=state.forward,
        cache=static,
        record=state.record.select(keep),
        sampling=state.sampling,
        seeds=state.seeds.index_select(0, keep),
        mask=state.mask.index_select(0, keep),
        positions=state.positions.index_select(0, keep),
        width=state.width,
        pad_token_id=0,
        choose_fn=state.choose_fn,
    )
    new.step_ids.copy_(state.step_ids.index_select(0, keep))
    new.counter.copy_(state.counter)
    new.all_done.copy_(new.record.done.all())
    return new


@torch.no_grad()
def decode_chunk_static(
    model: torch.nn.Module,
    device: torch.device,
    prompts: list[list[int]],
    seeds: list[int],
    sampling: SamplingParams,
    *,
    prompt_ids: list[int],
    budgets: list[int],
    pad_token_id: int,
    mode: GraphMode | None = None,
    step_fn: Callable[..., Any] | None = None,
    kv_bucket_tokens: int | None = None,
    compact_every: int = 0,
) -> list[tuple[list[int], list[float], str]]:
    """Decode one chunk of rows (the contract of the torch rollout's dynamic
    ``_decode_chunk``); ``budgets`` are each row's token limits (already capped by the
    model length). ``mode`` is the requested :data:`GraphMode` (see :func:`graph_mode`);
    ``step_fn`` overrides the decode forward (tests). ``kv_bucket_tokens``: with the
    GQA-native decode attention, each step reads only the cache's filled columns rounded up
    to a multiple of it (one compiled / captured step per bucket) instead of its whole
    width. ``compact_every`` (0: never): every that many steps the host learns which rows
    are done (one synchronisation) and, when at most half of the batch is still live,
    decodes on with the live rows only (:func:`_compact`; a new batch size is a new graph).
    Every row's tokens and log-probs are the same either way."""
    from transformers import DynamicCache

    b = len(prompts)
    unique, expand, ids, prompt_mask, positions = prefill_rows(prompts, prompt_ids, pad_token_id, device)
    width = ids.shape[1]
    steps = max(budgets)
    mode = graph_mode(mode, model, device)

    # prefill: one forward per distinct prompt, then one row per sample
    prefill = model(
        input_ids=ids,
        attention_mask=prompt_mask,
        position_ids=positions,
        past_key_values=DynamicCache(config=model.config),
        use_cache=True,
        **last_logits_only(model),
    )
    logits = prefill.logits[:, -1, :].float().index_select(0, expand)
    cache = prefill.past_key_values
    del prefill
    if len(unique) < b:
        cache.batch_select_indices(expand)
    static = _static_cache_from(model, cache, b, width + steps)
    del cache
    mask = torch.zeros((b, width + steps), dtype=torch.long, device=device)
    mask[:, :width] = prompt_mask.index_select(0, expand)
    forward = step_fn if step_fn is not None else decode_step(model, device, mode)
    if mode == "forward":
        forward = _marking_steps(forward)
    record = DeviceDecodeRecord(budgets, sampling.stop_token_ids, sampling.stop_sequences, device)
    state = _StepState(
        forward=forward,
        cache=static,
        record=record,
        sampling=sampling,
        seeds=torch.tensor(seeds, dtype=torch.int64, device=device),
        mask=mask,
        positions=positions[:, -1:].index_select(0, expand) + 1,
        width=width,
        pad_token_id=pad_token_id,
        choose_fn=sampler(device, mode),
    )
    state.choose(logits)  # token 0, from the prefill
    del logits
    watch = _DoneWatch(state.all_done)
    watch.post()
    bucket = kv_bucket_tokens if kv_bucket_tokens and model.config._attn_implementation == GQA_DECODE else None

    def kv_len(t: int) -> int | None:
        """The cache columns step ``t`` reads: those filled once it fed token ``t - 1``
        (``width + t``), rounded up to the bucket; None: the whole width."""
        return None if bucket is None else kv_bucket(width + t, bucket, width + steps)

    graphs: dict[int | None, Any] = {}  # one captured step per key length
    capturing = mode == "step"
    rows = torch.arange(b)  # the original row of each row of the batch
    left: list[tuple[list[int], list[tuple[list[int], list[float], str]]]] = []  # rows compacted away
    for t in range(1, steps):
        if watch.finished():
            break
        if compact_every and t % compact_every == 0:
            done = state.record.done.cpu()
            live = int((~done).sum())
            if 0 < live <= len(done) // 2:
                gone, keep = done.nonzero().squeeze(1), (~done).nonzero().squeeze(1)
                left.append((rows[gone].tolist(), state.record.results_of(gone.to(device))))
                state = _compact(model, state, keep.to(device), width + t - 1, width + steps)
                rows = rows[keep]
                graphs = {}  # captured over the old buffers
                watch = _DoneWatch(state.all_done)
        state.kv_len = kv_len(t)
        graph = graphs.get(state.kv_len)
        if graph is not None:
            graph.replay()
        elif capturing and t + 1 < steps and kv_len(t + 1) == state.kv_len:
            # runs step t itself; the captured step t + 1 ran nothing: replayed next
            pool = next(iter(graphs.values())).pool() if graphs else None
            graph = _capture(state) if pool is None else _capture(state, pool=pool)
            if graph is None:
                _STEP_GRAPH_FAILED.add(id(model))
                capturing = False
            else:
                graphs[state.kv_len] = graph
        else:
            state.advance()
        watch.post()
    if not left:
        return state.record.results()
    out: list[Any] = [None] * b
    for ids, results in [(rows.tolist(), state.record.results()), *left]:
        for i, result in zip(ids, results, strict=True):
            out[i] = result
    return out
