"""Moving weights into an SGLang engine (the host copy a released CPU engine restarts from is
:class:`geartrain.weights.WeightCopy`).

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

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from geartrain.cluster.ports import free_port
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
        port = free_port("127.0.0.1")  # below the ephemeral range: geartrain.cluster.ports
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
