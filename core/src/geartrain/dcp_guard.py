"""Reading ``torch.distributed.checkpoint`` (DCP) checkpoints without running their code.

DCP stores two kinds of pickle: the ``.metadata`` file (read by a plain unpickler: a
:class:`~torch.distributed.checkpoint.metadata.Metadata`), and every non-tensor value of the
state dict (an optimizer's ``lr``, ``betas``, ...) as a ``torch.save`` blob inside a shard,
which DCP's default planner reads with a full ``torch.load`` (weights_only off). Either runs
whatever a crafted file's ``__reduce__`` says.

Here both are read with an allow-list: ``.metadata`` with an unpickler that only resolves
DCP's own metadata classes (and the few torch and pathlib values they hold), the blobs with
``torch.load(weights_only=True)``. :func:`check_dcp_pickles` checks every DCP directory in a
checkpoint this way before any backend opens it (megatron's ``dist_checkpointing`` stores
DCP underneath), and :func:`safe_dcp_reader` / :func:`safe_load_planner` are what a backend
passes to ``dcp.load`` so that the load itself never falls back to plain pickle.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any, BinaryIO

import torch

from geartrain.errors import CheckpointError, unpickling_reason

#: (module, name) pairs the ``.metadata`` pickle of torch 2.13's DCP refers to.
_METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    [
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ]
    + [
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        # megatron's dist_checkpointing keeps the save plans in the metadata (planner_data)
        *[
            ("torch.distributed.checkpoint.planner", name)
            for name in (
                "SavePlan",
                "WriteItem",
                "WriteItemType",
                "TensorWriteData",
                "LoadPlan",
                "ReadItem",
                "LoadItemType",
            )
        ],
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # maps a layout's name ("torch.strided") to it
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    ]
)


def _allowed(module: str, name: str) -> bool:
    if (module, name) in _METADATA_GLOBALS:
        return True
    # dtypes (torch.float32, ...) and memory formats are values, not callables that run code
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise CheckpointError(
                f"{self.where}: refusing to load it: it refers to {module}.{name}, which is not one of DCP's "
                "metadata classes (a crafted file); geartrain never unpickles code from a checkpoint"
            )
        return super().find_class(module, name)


def read_dcp_metadata(path: str | Path) -> Any:
    """The DCP ``Metadata`` in ``path`` (a ``.metadata`` file), read with the allow-list; a
    :class:`CheckpointError` naming the file for anything else in it."""
    with open(path, "rb") as fh:
        try:
            metadata = _MetadataUnpickler(fh, str(path)).load()
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - a truncated or garbled pickle
            raise CheckpointError(f"{path}: not a readable DCP metadata file ({type(exc).__name__}: {exc})") from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def load_dcp_bytes(value: io.BytesIO | bytes, where: str) -> Any:
    """A non-tensor DCP value, read with ``weights_only=True``."""
    stream = value if isinstance(value, io.BytesIO) else io.BytesIO(value)
    try:
        return torch.load(stream, weights_only=True)
    except pickle.UnpicklingError as exc:
        first = unpickling_reason(exc)
        raise CheckpointError(
            f"{where}: refusing to load it: it holds objects other than tensors and plain containers ({first}); "
            "geartrain never unpickles code from a checkpoint"
        ) from None
    except Exception as exc:  # noqa: BLE001 - not a torch.save blob at all
        raise CheckpointError(f"{where}: not a readable DCP value ({type(exc).__name__}: {str(exc)[:200]})") from None


def _metadata_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and (p.name == ".metadata" or p.name.endswith(".metadata")))


#: ``torch.save`` files a backend may keep next to its shards (megatron's ``common.pt``,
#: FSDP's ``trainer.pt`` and RNG files): all are read with ``weights_only=True``.
_TORCH_SAVE_SUFFIXES = (".pt", ".pth")


def check_dcp_pickles(checkpoint: str | Path) -> None:
    """Read every DCP ``.metadata`` under ``checkpoint`` and every non-tensor value its
    shards hold with the allow-lists above, and every ``*.pt`` file with
    ``weights_only=True``; raise :class:`CheckpointError` naming the file (and key) at the
    first that holds anything else. Reads only."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    for file in sorted(Path(checkpoint).rglob("*")):
        if file.is_file() and file.suffix in _TORCH_SAVE_SUFFIXES:
            with open(file, "rb") as fh:
                load_dcp_bytes(io.BytesIO(fh.read()), str(file))
    for meta_file in _metadata_files(Path(checkpoint)):
        metadata = read_dcp_metadata(meta_file)
        storage = metadata.storage_data or {}
        for index, info in storage.items():
            entry = metadata.state_dict_metadata.get(index.fqn)
            if not isinstance(entry, BytesStorageMetadata):
                continue
            shard = meta_file.parent / info.relative_path
            where = f"{shard} (value '{index.fqn}')"
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(
                    f"{where}: stored with transforms {info.transform_descriptors}, which geartrain does not read"
                )
            try:
                with open(shard, "rb") as fh:
                    fh.seek(info.offset)
                    blob = fh.read(info.length)
            except OSError as exc:
                raise CheckpointError(f"{where}: cannot be read ({exc})") from None
            load_dcp_bytes(blob, where)


def safe_dcp_reader(path: str | Path) -> Any:
    """A ``FileSystemReader`` for ``path`` whose ``read_metadata`` uses the allow-list."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_dcp_metadata(self._get_metadata_path(kwargs.get("rank")))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeReader(str(path))


def safe_load_planner() -> Any:
    """DCP's default load planner, reading non-tensor values with ``weights_only=True``."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class _SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            loaded = load_dcp_bytes(value, f"DCP value '{fqn}'")
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return _SafePlanner()
