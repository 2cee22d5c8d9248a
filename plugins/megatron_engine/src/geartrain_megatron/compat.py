"""Running megatron-core's CUDA-assuming code paths on a CPU-only machine.

megatron-core assumes a GPU in a handful of places that the real TP/PP/DP code passes
through even with the local (non-TransformerEngine) layer spec: tensors created with
``device="cuda"`` or ``device=torch.cuda.current_device()`` (attention masks, rotary
embeddings, pipeline shape exchange, optimizer bookkeeping), ``Tensor.cuda()`` (tied
embeddings under PP), ``torch.cuda.synchronize()``, and the model-parallel RNG tracker,
which swaps CUDA generator states. :func:`cpu_compat` bridges them while it is active:

* a :class:`~torch.overrides.TorchFunctionMode` rewrites every CUDA device argument to
  ``cpu``, turns ``Tensor.cuda()`` into a no-op and reports CPU tensors' ``type()`` as the
  CUDA type megatron's optimizer checks for;
* ``torch.cuda.current_device``/``synchronize`` and the CUDA RNG entry points are
  replaced by CPU equivalents: the CPU default generator plays the role of "the device
  generator", so the RNG tracker's ``fork()`` swaps CPU generator states exactly as it
  swaps CUDA ones on a GPU.

It is active only when no GPU is present (:func:`needed`); with a GPU it does nothing.
Every hook of the engine runs inside it; outside, torch is untouched.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_lock = threading.RLock()
_depth = 0
_saved: dict[tuple[Any, str], Any] = {}


def needed() -> bool:
    """True when megatron-core must run on the CPU (no CUDA device)."""
    return not torch.cuda.is_available()


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # torch.cuda.current_device() style ordinals
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _run_backward(
    func: Any,
    tensors: Any,
    grad_tensors: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: Any = None,
    *,
    gradient: Any = None,
) -> None:
    """``torch.autograd.backward`` (or ``Tensor.backward``, whose second argument is the
    gradient) without its ``__torch_function__`` dispatch, i.e. its body in torch 2.13."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    if func is torch.Tensor.backward:
        grad_tensors = gradient if gradient is not None else grad_tensors
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    inputs_tuple = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
    grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grad_tensors, len(tensors)), is_grads_batched=False)
    if retain_graph is None:
        retain_graph = create_graph
    _engine_run_backward(
        tensors, grads, retain_graph, create_graph, inputs_tuple, allow_unreachable=True, accumulate_grad=True
    )


class _CudaToCpu(TorchFunctionMode):
    """Maps CUDA device arguments to the CPU and makes ``Tensor.cuda()`` a no-op."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.autograd.backward or func is torch.Tensor.backward:
            # torch 2.13's backward dispatches to this mode, and a mode is off inside its
            # own handler: run the engine with the mode re-entered so that the backward
            # pass is bridged too (megatron's MoE all-to-all allocates on
            # `torch.cuda.current_device()` in its backward)
            with _CudaToCpu():
                return _run_backward(func, *args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron checks `t.type() == "torch.cuda.FloatTensor"` (optimizer, clipping)
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _cpu_rng_state(*_: Any, **__: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *_: Any, **__: Any) -> None:
    torch.set_rng_state(new_state)


def _seed_cpu(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


class _CpuEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, *_: Any) -> None:
        pass


class _CpuStream:
    """Stands in for ``torch.cuda.Stream`` (MoE's all-to-all dispatcher stages its
    device-to-host copies on a side stream): on the CPU every op is already ordered."""

    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def wait_stream(self, *_: Any) -> None:
        pass

    def wait_event(self, *_: Any) -> None:
        pass

    def record_event(self, *_: Any) -> _CpuEvent:
        return _CpuEvent()

    def synchronize(self) -> None:
        pass


_CURRENT_STREAM = _CpuStream()


def _to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's ``maybe_move_tensor_to_cpu`` converts to numpy only tensors it moves off
    a GPU; the MoE all-to-all then gets tensor split sizes that ``all_to_all_single`` refuses."""
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        return tensor.numpy() if as_numpy else tensor
    return tensor


def _patches() -> list[tuple[Any, str, Any]]:
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import token_dispatcher

    return [
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (torch.cuda, "Stream", _CpuStream),
        (torch.cuda, "current_stream", lambda *a, **k: _CURRENT_STREAM),
        (torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext()),
        (torch.cuda, "get_rng_state", _cpu_rng_state),
        (torch.cuda, "set_rng_state", _set_cpu_rng_state),
        (torch.cuda, "manual_seed", _seed_cpu),
        (torch.cuda, "manual_seed_all", _seed_cpu),
        (torch.cuda.random, "get_rng_state", _cpu_rng_state),
        (mrandom, "_get_cuda_rng_state", _cpu_rng_state),
        (token_dispatcher, "maybe_move_tensor_to_cpu", _to_host),
        (mrandom, "_set_cuda_rng_state", _set_cpu_rng_state),
    ]


@contextlib.contextmanager
def cpu_compat() -> Iterator[None]:
    """Run the body with megatron-core's CUDA spots bridged to the CPU (re-entrant;
    a no-op when a GPU is present)."""
    global _depth
    if not needed():
        yield
        return
    with _lock:
        if _depth == 0:
            for owner, name, replacement in _patches():
                _saved[(owner, name)] = getattr(owner, name)
                setattr(owner, name, replacement)
        _depth += 1
    try:
        with _CudaToCpu():
            yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for (owner, name), original in _saved.items():
                    setattr(owner, name, original)
                _saved.clear()
