"""The torch rollout's fixed-shape decode loop: a static KV cache and, on CUDA, the decode
step captured in CUDA graphs (``torch.compile(mode="reduce-overhead")``).

The dynamic loop of :mod:`geartrain.rollouts.torch_rollout` grows its cache by one column
per step and drops finished rows, so every step has new shapes: right for a CPU, where
each kernel is long, and wrong for a GPU, where a 0.5B model's decode step is hundreds of
tiny kernel launches. Here every decode step has the same shapes and addresses:

* the samples of a prompt share its prefill (one forward per distinct prompt into a
  dynamic cache), whose keys/values are then copied into a :class:`~transformers.StaticCache`
  of ``rows x (prompt width + steps)``;
* the attention mask is one ``[rows, width + steps]`` buffer updated in place;
* finished rows stay in the batch (their outputs are ignored): the per-row stop rules
  are the dynamic loop's (stop tokens, stop sequences, per-row budgets);
* sampling is the dynamic loop's own function on the live rows, so a seed gives the same
  tokens on either path (the log-probs equal up to float rounding: other attention shapes).

Only the model's decode forward is compiled, and only on CUDA (:func:`decode_step`); on
CPU it runs eagerly, which is how the logic is tested in CI.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from geartrain.rollouts.decode_record import DecodeRecord, prefill_rows

__all__ = ["decode_chunk_static", "decode_step", "drop_static_caches"]

Sampler = Callable[[torch.Tensor, Any, torch.Tensor, int], torch.Tensor]

_COMPILED: dict[int, Callable[..., Any]] = {}


def decode_step(model: torch.nn.Module, device: torch.device) -> Callable[..., Any]:
    """The forward used for decode steps: on CUDA ``model.forward`` compiled with
    ``mode="reduce-overhead"`` (CUDA graphs; one compilation per model object, reused
    across calls), elsewhere ``model.forward`` itself."""
    if device.type != "cuda":
        return model.forward
    key = id(model)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
    return _COMPILED[key]


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


@torch.no_grad()
def decode_chunk_static(
    model: torch.nn.Module,
    device: torch.device,
    prompts: list[list[int]],
    seeds: list[int],
    sampling: Any,
    *,
    prompt_ids: list[int],
    budgets: list[int],
    pad_token_id: int,
    sample: Sampler,
    step_fn: Callable[..., Any] | None = None,
) -> list[tuple[list[int], list[float], str]]:
    """Decode one chunk of rows (the contract of the torch rollout's dynamic
    ``_decode_chunk``); ``budgets`` are each row's token limits (already capped by the
    model length), ``sample`` the rollout's sampler. ``step_fn`` overrides
    :func:`decode_step` (tests)."""
    from transformers import DynamicCache

    b = len(prompts)
    unique, expand, ids, prompt_mask, positions = prefill_rows(prompts, prompt_ids, pad_token_id, device)
    width = ids.shape[1]
    steps = max(budgets)

    # prefill: one forward per distinct prompt, then one row per sample
    prefill = model(
        input_ids=ids,
        attention_mask=prompt_mask,
        position_ids=positions,
        past_key_values=DynamicCache(config=model.config),
        use_cache=True,
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
    next_pos = positions[:, -1:].index_select(0, expand) + 1  # [b, 1]
    step = step_fn if step_fn is not None else decode_step(model, device)

    record = DecodeRecord(budgets, sampling.stop_token_ids, sampling.stop_sequences, device)
    row_seeds = torch.tensor(seeds, dtype=torch.int64)
    active = torch.arange(b)  # rows still generating (also their batch rows: rows never move)
    step_ids = torch.full((b, 1), pad_token_id, dtype=torch.long, device=device)
    for t in range(steps):
        if t > 0:
            mask[:, width + t - 1] = 1  # the token fed in this step
            if device.type == "cuda":  # a new replay of the captured graphs; the last step's logits are consumed
                torch.compiler.cudagraph_mark_step_begin()
            out = step(
                input_ids=step_ids, attention_mask=mask, position_ids=next_pos, past_key_values=static, use_cache=True
            )
            logits = out.logits[:, -1, :].float()
            next_pos += 1
        on_device = active.to(device)
        live = logits.index_select(0, on_device) if len(active) < b else logits
        new = sample(live, sampling, row_seeds[active], t)
        new_lp = torch.log_softmax(live, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        keep = record.add(active, t, new, new_lp)
        step_ids[on_device, 0] = new  # finished rows keep decoding their last token, unread
        if not bool(keep.any()):
            break
        active = active[keep]
    return record.results()
