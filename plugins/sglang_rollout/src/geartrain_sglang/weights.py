"""Moving weights into an SGLang engine, and the host copy a CPU engine restarts from.

Two transports (``SglangOptions.weight_sync``), both one bucket at a time (cut by
:func:`geartrain.weights.bucketed`, after the core's name checks and tied-name fan-out)
between ``begin_weight_update`` and ``end_weight_update`` (SGLang's weight-update session):

* ``tensor``: ``update_weights_from_tensor`` per bucket; the engine's scheduler process
  receives the tensors through shared memory.
* ``distributed``: :class:`DistributedSender` joins a process group with the engine's
  workers (``init_weights_update_group``) as rank 0; per bucket, the engine is told the
  names, dtypes and shapes (``update_weights_from_distributed``) while this process
  broadcasts the tensors. This is the path of a rollout on other ranks than the trainer.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from geartrain.weights import BucketStats

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def counted(named_tensors: NamedTensors, stats: BucketStats) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass the stream through, adding each tensor to ``stats.num_tensors`` / ``stats.bytes``."""
    for name, tensor in named_tensors:
        stats.num_tensors += 1
        stats.bytes += tensor.numel() * tensor.element_size()
        yield name, tensor


def check_result(result: Any, what: str) -> None:
    """SGLang's control calls return ``(success, message)``; raise on failure."""
    if isinstance(result, tuple) and result and result[0] is False:
        raise RuntimeError(f"sglang {what} failed: {result[1] if len(result) > 1 else result}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _in_thread(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn`` in a thread; the returned ``join`` re-raises its exception."""
    error: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the joining thread
            error.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join() -> None:
        thread.join()
        if error:
            raise error[0]

    return join


class DistributedSender:
    """Rank 0 of a weight-update process group whose other ranks are the engine's workers."""

    def __init__(self, engine: Any, *, backend: str, world_size: int, group_name: str = "geartrain_weights") -> None:
        from sglang.srt.utils.common import init_custom_process_group

        self.group_name = group_name
        port = free_port()
        holder: dict[str, Any] = {}

        def join_group() -> None:
            holder["group"] = init_custom_process_group(
                backend=backend,
                init_method=f"tcp://127.0.0.1:{port}",
                world_size=world_size,
                rank=0,
                group_name=group_name,
            )

        join = _in_thread(join_group)
        result = engine.init_weights_update_group(
            master_address="127.0.0.1",
            master_port=port,
            rank_offset=1,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        join()
        check_result(result, "init_weights_update_group")
        self.group = holder["group"]

    def send(self, engine: Any, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Broadcast one bucket; the engine loads it."""
        tensors = [t.detach().contiguous() for _, t in bucket]

        def broadcast() -> None:
            for tensor in tensors:
                torch.distributed.broadcast(tensor, src=0, group=self.group)

        join = _in_thread(broadcast)
        result = engine.update_weights_from_distributed(
            names=[n for n, _ in bucket],
            dtypes=[dtype_name(t.dtype) for t in tensors],
            shapes=[list(t.shape) for t in tensors],
            group_name=self.group_name,
            flush_cache=False,
        )
        join()
        check_result(result, "update_weights_from_distributed")

    def close(self, engine: Any | None) -> None:
        if engine is not None:
            engine.destroy_weights_update_group(self.group_name)
        torch.distributed.destroy_process_group(self.group)


class WeightCopy:
    """A host copy of the last synced weights (name -> CPU tensor), merged across syncs,
    optionally spilled to one safetensors file while the engine is released."""

    def __init__(self, spill_path: Path) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self._spill_path = spill_path
        self.spilled = False

    def __len__(self) -> int:
        return len(self._tensors) if not self.spilled else len(self._names())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def tee(self, named_tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass the stream through, keeping a CPU copy of each tensor."""
        self.restore()
        for name, tensor in named_tensors:
            held = self._tensors.get(name)
            if held is not None and held.shape == tensor.shape and held.dtype == tensor.dtype:
                held.copy_(tensor.detach())
            else:
                self._tensors[name] = tensor.detach().to("cpu", copy=True)
            yield name, tensor

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The held tensors (read back one at a time when spilled)."""
        if not self.spilled:
            yield from list(self._tensors.items())
            return
        from safetensors import safe_open

        with safe_open(str(self._spill_path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)

    def _names(self) -> list[str]:
        from safetensors import safe_open

        with safe_open(str(self._spill_path), framework="pt") as f:
            return list(f.keys())

    def spill(self) -> None:
        """Write the held tensors to disk and drop them from memory."""
        if self.spilled or not self._tensors:
            return
        from safetensors.torch import save_file

        self._spill_path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self._tensors.items()}, str(self._spill_path))
        self._tensors = {}
        self.spilled = True

    def restore(self) -> None:
        """Bring spilled tensors back into memory (a sync merges into them)."""
        if not self.spilled:
            return
        from safetensors.torch import load_file

        self._tensors = load_file(str(self._spill_path))
        self.spilled = False
        self._spill_path.unlink(missing_ok=True)

    def clear(self) -> None:
        self._tensors = {}
        self.spilled = False
        self._spill_path.unlink(missing_ok=True)
