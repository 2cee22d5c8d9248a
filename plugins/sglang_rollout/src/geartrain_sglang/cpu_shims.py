"""Import placeholders that let SGLang's Engine run on CPU without its CUDA-only packages.

SGLang imports ``sgl_kernel`` (its compiled CUDA kernels, shipped as ``sglang-kernel``) and
``torchvision`` (multimodal preprocessing) at module level, although the CPU path with
``attention_backend="torch_native"`` runs none of their code. Neither exists as a CPU build
next to ``torch==2.13.0``. :func:`install` adds a meta-path finder that, for these two names
only and only when no real package is found, returns placeholder modules: any attribute is a
placeholder class that can be referenced or subclassed at import time, and it (or a
subclass) raises :class:`ShimCalled` when actually called, so a code path that would need the real
kernels fails loudly instead of silently computing nothing.

It also makes per-request seeds work on CPU. SGLang honours ``sampling_seed`` (a hash-based,
batch-independent draw per row and position) only in its deterministic-inference mode,
which refuses every attention backend that runs on CPU. After
``sglang.srt.sampling.sampling_batch_info`` is imported, :func:`_seeded_sampling` wraps
``SamplingBatchInfo.from_schedule_batch`` so a batch whose requests carry seeds gets the
per-row seed tensor that mode would have built; SGLang's own torch samplers then use it,
with the hash its compiled CPU kernel would compute (:mod:`geartrain_sglang.cpu_ops`).

And it lets SGLang's LoRA layers run on CPU (``lora_backend="torch_native"``). They stage
small index tensors in pinned host memory (``pin_memory=True`` in ``torch.tensor`` and
friends, ``Tensor.pin_memory()``) for asynchronous copies to the GPU; without an
accelerator torch has no pinned allocator and raises. When ``sglang.srt.lora.layers`` or
``sglang.srt.lora.backend.torch_backend`` is imported in a process with no accelerator,
:func:`_pinless` gives those two modules a ``torch`` whose tensor factories drop
``pin_memory``, and makes ``Tensor.pin_memory()`` return a plain copy (what it returns,
minus the pinning). Both only change calls that would otherwise raise.

SGLang starts its scheduler in ``spawn``-ed processes, which do not inherit this process's
``sys.meta_path``. The CPU environment therefore also holds a ``.pth`` line (see the
plugin's README) that calls :func:`install` at interpreter start-up when the environment
variable :data:`ENV_VAR` is ``1``; the rollout sets it before the Engine starts, so the
placeholders exist only in processes that run SGLang on CPU.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

#: Set to ``1`` (by the rollout, on CPU) to install the placeholders in every process started after.
ENV_VAR = "GEARTRAIN_SGLANG_CPU_SHIMS"
#: Top-level packages that get a placeholder when they cannot be imported.
SHIMMED = ("sgl_kernel", "torchvision")
#: A line for a ``.pth`` file in site-packages: installs the placeholders at start-up when asked.
PTH_LINE = (
    "import os; os.environ.get('GEARTRAIN_SGLANG_CPU_SHIMS') == '1' and "
    "__import__('geartrain_sglang.cpu_shims').cpu_shims.install()\n"
)
#: ``__version__`` of a placeholder package (older than any real release).
PLACEHOLDER_VERSION = "0.0.0+geartrain.placeholder"


class ShimCalled(RuntimeError):
    """A placeholder stood in for code that actually ran."""


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise ShimCalled(
            f"{cls.__qualname__} is a geartrain CPU placeholder (the real package is not installed); "
            "this SGLang code path needs the CUDA build"
        )


def _placeholder(qualname: str) -> type:
    return _PlaceholderMeta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname, "__module__": "placeholder"})


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _PlaceholderModule(spec.name)
        module.__path__ = []  # a package: submodules come through the finder too
        # transformers parses the version of every package it finds importable
        module.__version__ = PLACEHOLDER_VERSION
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ == "sgl_kernel":
            from geartrain_sglang import cpu_ops

            cpu_ops.register()


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._real: dict[str, bool] = {}

    def _has_real(self, top: str) -> bool:
        if top not in self._real:
            self._real[top] = importlib.machinery.PathFinder.find_spec(top) is not None
        return self._real[top]

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        top = fullname.partition(".")[0]
        if top not in SHIMMED or self._has_real(top):
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)


#: Module -> function patching it right after it is imported.
PATCHED_MODULES = {
    "sglang.srt.sampling.sampling_batch_info": "_seeded_sampling",
    "sglang.srt.lora.layers": "_pinless",
    "sglang.srt.lora.backend.torch_backend": "_pinless",
}
#: Seed of an unseeded row in a batch where other rows have seeds (SGLang's own default).
DEFAULT_ROW_SEED = 42


def _seeded_sampling(module: types.ModuleType) -> None:
    import torch

    cls = module.SamplingBatchInfo
    original = cls.from_schedule_batch.__func__
    if getattr(original, "_geartrain_seeded", False):
        return

    def from_schedule_batch(klass: type, batch: Any, vocab_size: int) -> Any:
        info = original(klass, batch, vocab_size)
        seeds = [r.sampling_params.sampling_seed for r in batch.reqs]
        if info.sampling_seed is None and any(s is not None for s in seeds):
            info.sampling_seed = torch.tensor(
                [DEFAULT_ROW_SEED if s is None else s for s in seeds], dtype=torch.int64, device=batch.device
            )
        return info

    from_schedule_batch._geartrain_seeded = True  # type: ignore[attr-defined]
    cls.from_schedule_batch = classmethod(from_schedule_batch)


#: The tensor factories that take ``pin_memory`` (those SGLang's LoRA modules call with it).
PIN_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like", "ones_like")


def _unpinned(factory: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    call.__name__ = call.__qualname__ = factory.__name__
    call.__doc__ = factory.__doc__
    return call


class _PinlessTorch(types.ModuleType):
    """``torch`` as one module sees it: :data:`PIN_FACTORIES` ignore ``pin_memory``."""

    def __init__(self, torch: types.ModuleType) -> None:
        super().__init__("torch")
        self._torch = torch
        for name in PIN_FACTORIES:
            setattr(self, name, _unpinned(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def _copy_for_pin(tensor: Any, device: Any = None) -> Any:
    """``Tensor.pin_memory`` without an accelerator: the copy it returns, in ordinary memory."""
    import torch

    return tensor.clone(memory_format=torch.contiguous_format)


_pin_memory_replaced = False


def _pinless(module: types.ModuleType) -> None:
    import torch

    if torch.accelerator.is_available() or isinstance(module.torch, _PinlessTorch):
        return
    global _pin_memory_replaced
    module.torch = _PinlessTorch(torch)
    if not _pin_memory_replaced:
        # process-wide, but without an accelerator every call of it would raise
        torch.Tensor.pin_memory = _copy_for_pin  # type: ignore[method-assign]
        _pin_memory_replaced = True


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: str) -> None:
        self._inner = inner
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        globals()[self._patch](module)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHED_MODULES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


def installed() -> bool:
    return any(isinstance(f, _Finder) for f in sys.meta_path)


def install() -> None:
    """Add the placeholder finder and the post-import patches (idempotent). The finder only
    answers for :data:`SHIMMED` names that have no real package, so it never shadows an
    installed one."""
    if not installed():
        sys.meta_path.append(_Finder())
        sys.meta_path.insert(0, _PatchingFinder())
        for name, patch in PATCHED_MODULES.items():
            if name in sys.modules:
                globals()[patch](sys.modules[name])
