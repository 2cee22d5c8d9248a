"""Full (unsharded) weights under their transformers names: streaming into a rollout in
size-bounded buckets, and exporting a plain Hugging Face directory."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from geartrain.types import SyncStats, WeightReceiver
from geartrain.weights import send_weights, stream_weights

from geartrain_fsdp.sharding import FSDPModel


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on this rank (a collective for DTensors)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def hf_state_entries(model: FSDPModel) -> list[tuple[str, torch.Tensor]]:
    """``(name, possibly sharded tensor)`` exactly as the transformers model's
    ``state_dict`` names them (tied weights appear under each of their names)."""
    return list(model.hf.state_dict(keep_vars=True).items())


def iter_full_weights(
    model: FSDPModel, dtype: torch.dtype, bucket_bytes: int, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors named as in the transformers checkpoint, cast to ``dtype``, gathered
    ``bucket_bytes`` at a time. Collective: every rank must consume it to the end."""
    return stream_weights(hf_state_entries(model), dtype=dtype, bucket_bytes=bucket_bytes, device=device, materialize=_full)


def reshard_for_rollout(model: FSDPModel, rollout: WeightReceiver | None) -> SyncStats:
    """See :func:`geartrain.hookspecs.reshard_for_rollout`."""
    dtype = rollout.dtype if rollout is not None else torch.float32
    bucket_bytes = rollout.bucket_bytes if rollout is not None else 64 << 20
    if model.meshes.distributed:
        # every rank must plan identical buckets: take the receivers' settings from rank 0
        settings = [str(dtype), bucket_bytes, rollout is not None]
        gathered: list[Any] = [None] * dist.get_world_size(model.meshes.ctx_group)
        dist.all_gather_object(gathered, settings, group=model.meshes.ctx_group)
        with_receiver = [s for s in gathered if s[2]] or gathered
        dtype = getattr(torch, with_receiver[0][0].replace("torch.", ""))
        bucket_bytes = with_receiver[0][1]
    return send_weights(
        hf_state_entries(model), rollout, dtype=dtype, bucket_bytes=bucket_bytes, device=model.device, materialize=_full
    )


SHARD_BYTES = 4 << 30


def export_hf(model: FSDPModel, path: Path, tokenizer: Any | None) -> None:
    """See :func:`geartrain.hookspecs.export_hf`: rank 0 writes ``config.json``,
    ``generation_config.json`` (when the model has one), ``model*.safetensors`` (tied
    weights once, as transformers saves them) and the tokenizer."""
    from safetensors.torch import save_file

    rank0 = not model.meshes.distributed or dist.get_rank(model.meshes.ctx_group) == 0
    hf = model.hf
    dtype = next(iter(t for _, t in hf_state_entries(model))).dtype
    tied = _tied_names(hf)
    files: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in iter_full_weights(model, dtype, 256 << 20, device="cpu"):
        if not rank0 or name in tied:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if files[-1] and size + nbytes > SHARD_BYTES:
            files.append({})
            size = 0
        files[-1][name] = tensor.contiguous()
        size += nbytes
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
    if len(files) == 1:
        save_file(files[0], str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        index: dict[str, Any] = {"metadata": {"total_size": 0}, "weight_map": {}}
        for i, chunk in enumerate(files):
            fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            save_file(chunk, str(path / fname), metadata={"format": "pt"})
            for name, t in chunk.items():
                index["weight_map"][name] = fname
                index["metadata"]["total_size"] += t.numel() * t.element_size()
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
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
