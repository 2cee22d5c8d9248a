"""Full weights under their transformers names, from any TP/PP/VPP layout: streamed into
a rollout in size-bounded buckets, and written as a plain Hugging Face directory.

Every rank first learns which pipeline stage owns which parameter (one small
``all_gather_object`` over the pipeline group), so all ranks plan the same buckets. For
each tensor the owning stage's TP ranks all-gather their shards and rebuild the HF
tensors (:meth:`~geartrain_megatron.convert.Rule.from_shards`); the owner then
broadcasts them along the pipeline group, so every rank ends with the full tensors of one
bucket at a time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from geartrain.export import write_safetensors
from geartrain.types import SyncStats, WeightReceiver
from geartrain.weights import BucketStats, drain, plan_buckets, stream_buckets

from geartrain_megatron import parallel
from geartrain_megatron.compat import cpu_compat
from geartrain_megatron.convert import Rule
from geartrain_megatron.engine import MegatronModel
from geartrain_megatron.modeling import chunk_rules


@dataclass(frozen=True, slots=True)
class Entry:
    """One megatron parameter as the whole group sees it."""

    order: tuple
    stage: int
    chunk: int
    name: str
    rule: Rule
    hf_shapes: tuple[tuple[int, ...], ...]


def _order(rule: Rule) -> tuple:
    """HF checkpoint order: embedding, layers by number, final norm, output head."""
    first = rule.hf_names[0]
    if first == "model.embed_tokens.weight" and rule.kind == "vocab":
        return (0,)
    if first.startswith("model.layers."):
        return (1, int(first.split(".")[2]), first)
    if first.startswith("model.norm"):
        return (2, first)
    return (3, first)


def _local_entries(model: MegatronModel) -> list[Entry]:
    out = []
    tp = model.layout.tp
    for ci, chunk in enumerate(model.modules):
        for name, param, rule in chunk_rules(chunk, model.hf_config, value_head=model.value_head):
            if model.tied and name == "output_layer.weight":
                continue  # the last stage's copy of the tied embedding: the first stage's is sent
            meta = [torch.empty(param.shape, device="meta")] * tp
            shapes = tuple(tuple(t.shape) for t in rule.from_shards(meta, model.dims))
            out.append(
                Entry(order=_order(rule), stage=model.layout.pp_rank, chunk=ci, name=name, rule=rule, hf_shapes=shapes)
            )
    return out


def plan_entries(model: MegatronModel) -> list[Entry]:
    """Every parameter of the model (all stages), in HF order; the same on every rank."""
    local = _local_entries(model)
    if model.layout.ep > 1 and any(e.rule.expert is not None for e in local):
        raise NotImplementedError(
            "reshard_for_rollout / export_hf of MoE experts under expert parallelism (joining the "
            "experts of every expert-parallel rank) is not built yet"
        )
    if model.layout.pp > 1:
        gathered: list[Any] = [None] * model.layout.pp
        dist.all_gather_object(gathered, local, group=parallel.groups()["pp"])
        local = [e for part in gathered for e in part]
    return sorted(local, key=lambda e: e.order)


def _gather_entry(
    model: MegatronModel, entry: Entry, params: dict[tuple[int, str], torch.Tensor]
) -> list[torch.Tensor]:
    lay = model.layout
    groups = parallel.groups()
    if entry.stage == lay.pp_rank:
        local = params[(entry.chunk, entry.name)].detach()
        if lay.tp > 1:
            shards = [torch.empty_like(local) for _ in range(lay.tp)]
            dist.all_gather(shards, local.contiguous(), group=groups["tp"])
        else:
            shards = [local]
        tensors = [t.contiguous() for t in entry.rule.from_shards(shards, model.dims)]
    else:
        tensors = [torch.empty(s, dtype=torch.float32, device=model.device) for s in entry.hf_shapes]
    if lay.pp > 1:
        src = dist.get_process_group_ranks(groups["pp"])[entry.stage]
        for t in tensors:
            dist.broadcast(t, src=src, group=groups["pp"])
    return tensors


def iter_hf_weights(
    model: MegatronModel, dtype: torch.dtype, bucket_bytes: int, stats: BucketStats | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors named as in the transformers checkpoint, cast to ``dtype``, gathered
    ``bucket_bytes`` at a time. Collective: every rank must consume it to the end."""
    entries = plan_entries(model)
    itemsize = torch.empty((), dtype=dtype).element_size()
    # one item per HF tensor: a fused megatron tensor (qkv, gate/up) may straddle two
    # buckets; its other parts then wait in `pending` (at most one entry's worth)
    sizes = [
        ((i, j), int(torch.Size(s).numel()) * itemsize)
        for i, e in enumerate(entries)
        for j, s in enumerate(e.hf_shapes)
    ]
    buckets = plan_buckets(sizes, bucket_bytes)
    params = {(ci, n): p for ci, chunk in enumerate(model.modules) for n, p in chunk.named_parameters()}
    pending: dict[int, list[torch.Tensor | None]] = {}
    # MoE: HF stacks a layer's experts into one tensor ([E, ...]); each expert's slice waits
    # here until the last one is gathered (a bucket may then exceed `bucket_bytes` by one
    # stacked tensor)
    experts: dict[str, dict[int, torch.Tensor]] = {}
    num_experts = getattr(model.hf_config, "num_local_experts", 0)

    def gather(keys: list[tuple[int, int]]) -> list[tuple[str, torch.Tensor]]:
        named: list[tuple[str, torch.Tensor]] = []
        with cpu_compat(), torch.no_grad():
            for i, j in keys:
                entry = entries[i]
                if i not in pending:
                    # always copies: the receiver must not alias a live parameter
                    pending[i] = [
                        t.to(device="cpu", dtype=dtype, copy=True) for t in _gather_entry(model, entry, params)
                    ]
                tensor = pending[i][j]
                pending[i][j] = None
                assert tensor is not None
                name = entry.rule.hf_names[j]
                if entry.rule.expert is None:
                    named.append((name, tensor))
                else:
                    experts.setdefault(name, {})[entry.rule.expert] = tensor
                    if len(experts[name]) == num_experts:
                        parts = experts.pop(name)
                        named.append((name, torch.stack([parts[e] for e in range(num_experts)])))
                if all(t is None for t in pending[i]):
                    del pending[i]
        return named

    yield from stream_buckets(buckets, gather, stats)


def reshard_for_rollout(model: MegatronModel, rollout: WeightReceiver | None) -> SyncStats:
    """See :func:`geartrain.hookspecs.reshard_for_rollout`."""
    start = time.perf_counter()
    stats = BucketStats()
    dtype = rollout.dtype if rollout is not None else torch.float32
    bucket_bytes = rollout.bucket_bytes if rollout is not None else 64 << 20
    if model.layout.world > 1:
        # every rank must plan identical buckets: take the receivers' settings
        gathered: list[Any] = [None] * model.layout.world
        dist.all_gather_object(gathered, [str(dtype), bucket_bytes, rollout is not None])
        chosen = [s for s in gathered if s[2]] or gathered
        dtype = getattr(torch, chosen[0][0].replace("torch.", ""))
        bucket_bytes = chosen[0][1]
    stream = iter_hf_weights(model, dtype, bucket_bytes, stats)
    if rollout is not None:
        rollout.update_weights(stream)
    drain(stream)  # finishes the collectives if the receiver stopped early
    return SyncStats(
        seconds=time.perf_counter() - start,
        bytes=stats.bytes,
        num_tensors=stats.num_tensors,
        num_buckets=stats.num_buckets,
        max_bucket_bytes=stats.max_bucket_bytes,
    )


def export_hf(model: MegatronModel, path: Path, tokenizer: Any | None) -> None:
    """See :func:`geartrain.hookspecs.export_hf`: global rank 0 writes ``config.json``,
    ``model*.safetensors`` and the tokenizer; every rank returns once it is complete."""
    rank0 = dist.get_rank() == 0
    # every rank takes part in the gathers; global rank 0 keeps the tensors
    tensors = [(name, tensor) for name, tensor in iter_hf_weights(model, torch.float32, 256 << 20) if rank0]
    if rank0:
        path.mkdir(parents=True, exist_ok=True)
        model.hf_config.save_pretrained(path)
        write_safetensors(path, tensors)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
    if model.layout.world > 1:
        dist.barrier()
