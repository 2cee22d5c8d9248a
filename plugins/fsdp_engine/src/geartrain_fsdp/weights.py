"""Full (unsharded) weights under their transformers names: streaming into a rollout in
size-bounded buckets, and exporting a plain Hugging Face directory."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from geartrain.export import write_safetensors
from geartrain.types import AdapterReceiver, SyncStats, WeightReceiver
from geartrain.weights import (
    BucketStats,
    deliver_stream,
    plan_buckets,
    refuse_non_finite,
    send_weights,
    stream_buckets,
    stream_weights,
    tied_groups,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from geartrain_fsdp.sharding import FSDPModel


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on this rank (a collective for DTensors).

    On gloo, a tensor sharded by rows over one mesh dimension (FSDP2's parameters, HSDP's
    too) is gathered with a plain ``all_gather`` into a list rather than by
    ``DTensor.full_tensor``: on gloo that goes through ``allgather_coalesced``, the path of
    the native heap crash of issue 38 (docs/architecture.md, "Known native crash").
    Other placements, and NCCL, keep ``full_tensor``."""
    if not isinstance(tensor, DTensor):
        return tensor
    mesh_dim = _row_sharded_dim(tensor)
    if mesh_dim is None or dist.get_backend(tensor.device_mesh.get_group(mesh_dim)) != "gloo":
        return tensor.full_tensor()
    return _all_gather_rows(tensor, mesh_dim)


def _row_sharded_dim(tensor: DTensor) -> int | None:
    """The mesh dimension ``tensor`` is sharded over by rows, when that is its only
    sharding (every other mesh dimension replicates it); otherwise ``None``."""
    sharded = [i for i, p in enumerate(tensor.placements) if not isinstance(p, Replicate)]
    if len(sharded) != 1 or tensor.placements[sharded[0]] != Shard(0):
        return None
    return sharded[0]


def _all_gather_rows(tensor: DTensor, mesh_dim: int) -> torch.Tensor:
    """``tensor.full_tensor()`` for a tensor sharded by rows over ``mesh_dim``, by one
    ``dist.all_gather`` of equal-sized pieces (DTensor shards as ``torch.chunk`` does:
    ceil-sized pieces, the last ones shorter or empty, so each is padded to the first's)."""
    group = tensor.device_mesh.get_group(mesh_dim)
    ranks = dist.get_world_size(group)
    rows = tensor.shape[0]
    piece_rows = -(-rows // ranks)
    local = tensor.to_local()
    piece = local.new_zeros((piece_rows, *local.shape[1:]))
    piece[: local.shape[0]] = local
    pieces = [torch.empty_like(piece) for _ in range(ranks)]
    dist.all_gather(pieces, piece, group=group)
    return torch.cat(pieces)[:rows]


def hf_state_entries(model: FSDPModel) -> list[tuple[str, torch.Tensor]]:
    """``(name, possibly sharded tensor)`` exactly as the transformers model's
    ``state_dict`` names them (tied weights appear under each of their names)."""
    return list(model.hf.state_dict(keep_vars=True).items())


def iter_full_weights(
    model: FSDPModel, dtype: torch.dtype, bucket_bytes: int, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors named as in the transformers checkpoint, cast to ``dtype``, gathered
    ``bucket_bytes`` at a time. Collective: every rank must consume it to the end."""
    return stream_weights(
        hf_state_entries(model), dtype=dtype, bucket_bytes=bucket_bytes, device=device, materialize=_full
    )


def reshard_for_rollout(model: FSDPModel, rollout: WeightReceiver | None) -> SyncStats:
    """See :func:`geartrain.hookspecs.reshard_for_rollout`."""
    dtype = rollout.dtype if rollout is not None else torch.float32
    bucket_bytes = rollout.bucket_bytes if rollout is not None else 64 << 20
    adapters = isinstance(rollout, AdapterReceiver) and rollout.accepts_adapters
    if model.meshes.distributed:
        # every rank must plan identical buckets: take the receivers' settings from rank 0
        settings = [str(dtype), bucket_bytes, rollout is not None, adapters]
        gathered: list[Any] = [None] * dist.get_world_size(model.meshes.ctx_group)
        dist.all_gather_object(gathered, settings, group=model.meshes.ctx_group)
        with_receiver = [s for s in gathered if s[2]] or gathered
        dtype = getattr(torch, with_receiver[0][0].replace("torch.", ""))
        bucket_bytes = with_receiver[0][1]
        adapters = all(s[3] for s in with_receiver)
    if model.peft is None:
        return send_weights(
            hf_state_entries(model),
            rollout,
            dtype=dtype,
            bucket_bytes=bucket_bytes,
            device=model.device,
            materialize=_full,
        )
    assert model.config.lora is not None
    if model.config.lora.sync == "adapter" and adapters:
        return _sync_adapter(model, rollout, dtype, bucket_bytes)  # type: ignore[arg-type]
    stats = BucketStats()
    return _send_stream(iter_merged_weights(model, dtype, bucket_bytes, model.device, stats), rollout, stats)


def _send_stream(
    stream: Iterator[tuple[str, torch.Tensor]], rollout: WeightReceiver | None, stats: BucketStats
) -> SyncStats:
    return deliver_stream(stream, rollout, stats, start=time.perf_counter())


def iter_merged_weights(
    model: FSDPModel,
    dtype: torch.dtype,
    bucket_bytes: int,
    device: torch.device | str = "cpu",
    stats: BucketStats | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """LoRA: the full weights of the adapted model (``W + scale x B A`` where adapted) under
    their transformers names, cast to ``dtype``, ``bucket_bytes`` at a time. Collective."""
    from geartrain_fsdp.lora import merged_weight, sites, transformers_name

    adapted = {f"{module}.weight": site for module, site in sites(model.hf).items()}
    entries = [(plain, t) for name, t in hf_state_entries(model) if (plain := transformers_name(name)) is not None]
    # a tied weight (not adapted) is planned once under all its names, as by stream_weights
    groups = tied_groups(entries, apart=adapted)
    itemsize = torch.empty((), dtype=dtype).element_size()
    by_name = {names[0]: tensor for names, tensor in groups}
    target = torch.device(device)

    def gather(keys: list[tuple[str, ...]]) -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        for names in keys:
            site = adapted.get(names[0])
            live = by_name[names[0]].detach()
            full = (merged_weight(site, _full) if site is not None else _full(live)).to(device=target, dtype=dtype)
            full = full.clone() if full is live else full  # never alias a live parameter
            out += [(name, full) for name in names]
        return out

    buckets = plan_buckets([(names, t.numel() * itemsize) for names, t in groups], bucket_bytes)
    return stream_buckets(buckets, gather, stats)


def adapter_tensors(
    model: FSDPModel, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """The adapter's tensors, full, named as in a PEFT adapter file. Collective. Raises
    :class:`~geartrain.errors.NonFiniteWeightsError` when one holds NaN or inf (on every
    rank: each holds the full tensors), so neither a sync nor an export carries it."""
    from geartrain_fsdp.lora import adapter_names, sites

    out: dict[str, torch.Tensor] = {}
    for module, site in sites(model.hf).items():
        a_name, b_name = adapter_names(module)
        out[a_name] = _full(site.lora_a.detach()).to(device=device, dtype=dtype, copy=True)
        out[b_name] = _full(site.lora_b.detach()).to(device=device, dtype=dtype, copy=True)
    refuse_non_finite(list(out.items()))
    return out


def _sync_adapter(
    model: FSDPModel, rollout: AdapterReceiver | None, dtype: torch.dtype, bucket_bytes: int
) -> SyncStats:
    """Adapter-only sync: the base once (the rollout may have started from other weights),
    then only the adapter tensors through ``update_adapter``."""
    from geartrain_fsdp.lora import ADAPTER, adapter_config, transformers_name

    start = time.perf_counter()
    stats = BucketStats()
    if not model.base_synced:
        base = [(plain, t) for name, t in hf_state_entries(model) if (plain := transformers_name(name)) is not None]
        stream = stream_weights(
            base, dtype=dtype, bucket_bytes=bucket_bytes, device=model.device, materialize=_full, stats=stats
        )
        _send_stream(stream, rollout, stats)  # type: ignore[arg-type]
        model.base_synced = True
    tensors = adapter_tensors(model, dtype, model.device)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if rollout is not None:
        rollout.update_adapter(ADAPTER, tensors, adapter_config(model.peft, model.base))
    return SyncStats(
        seconds=time.perf_counter() - start,
        bytes=stats.bytes + nbytes,
        num_tensors=stats.num_tensors + len(tensors),
        num_buckets=stats.num_buckets + 1,
        max_bucket_bytes=max(stats.max_bucket_bytes, nbytes),
    )


def export_hf(model: FSDPModel, path: Path, tokenizer: Any | None) -> None:
    """See :func:`geartrain.hookspecs.export_hf`: rank 0 writes ``config.json``,
    ``generation_config.json`` (when the model has one), ``model*.safetensors`` (tied
    weights once, as transformers saves them) and the tokenizer.

    With LoRA adapters: a PEFT adapter directory instead (``adapter_config.json``,
    ``adapter_model.safetensors``, the tokenizer; ``PeftModel.from_pretrained`` loads it
    over the base), plus the merged model in ``merged/`` when ``lora.export_merged``."""
    if model.peft is None:
        dtype = next(iter(t for _, t in hf_state_entries(model))).dtype
        _write_hf(model, path, tokenizer, iter_full_weights(model, dtype, 256 << 20, device="cpu"))
        return
    assert model.config.lora is not None
    _write_adapter(model, path, tokenizer)
    if model.config.lora.export_merged:
        dtype = next(t for n, t in hf_state_entries(model) if ".lora_" not in n).dtype
        _write_hf(model, path / "merged", tokenizer, iter_merged_weights(model, dtype, 256 << 20, device="cpu"))


def _write_adapter(model: FSDPModel, path: Path, tokenizer: Any | None) -> None:
    """Rank 0 writes the PEFT adapter directory (fp32 adapter tensors). Collective."""
    from safetensors.torch import save_file

    from geartrain_fsdp.lora import adapter_config

    tensors = adapter_tensors(model, torch.float32, "cpu")
    if _rank0(model):
        path.mkdir(parents=True, exist_ok=True)
        config = adapter_config(model.peft, model.base)
        (path / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            str(path / "adapter_model.safetensors"),
            metadata={"format": "pt"},
        )
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
    _barrier(model)


def _rank0(model: FSDPModel) -> bool:
    return not model.meshes.distributed or dist.get_rank(model.meshes.ctx_group) == 0


def _write_hf(model: FSDPModel, path: Path, tokenizer: Any | None, stream: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Rank 0 writes ``stream`` (full tensors by transformers name) as a transformers
    directory; every rank consumes it (the gathers are collective)."""
    rank0 = _rank0(model)
    hf = model.hf
    tied = _tied_names(hf)
    # every rank consumes the stream (the gathers are collective); rank 0 keeps the tensors
    tensors = [(name, tensor) for name, tensor in stream if rank0 and name not in tied]
    if not rank0:
        _barrier(model)  # return once the directory is complete, on every rank
        return
    path.mkdir(parents=True, exist_ok=True)
    config = hf.config
    attn = config._attn_implementation
    try:
        config._attn_implementation = "sdpa"  # the packed attention is this engine's, not the export's
        config.save_pretrained(path)
    finally:
        config._attn_implementation = attn
    if getattr(hf, "generation_config", None) is not None and hf.can_generate():
        hf.generation_config.save_pretrained(path)
    write_safetensors(path, tensors)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    _barrier(model)


def _barrier(model: FSDPModel) -> None:
    if model.meshes.distributed:
        dist.barrier(group=model.meshes.ctx_group)


def _tied_names(hf: torch.nn.Module) -> set[str]:
    """Names transformers leaves out of a checkpoint because they alias another weight."""
    if not getattr(hf.config, "tie_word_embeddings", False):
        return set()
    out = hf.get_output_embeddings()
    if out is None:
        return set()
    for name, module in hf.named_modules():
        if module is out:
            return {f"{name}.weight"}
    return set()
