"""The SGLang plugin without an engine: metadata, options, lazy imports, the CPU shims."""

from __future__ import annotations

import importlib
import importlib.util
import os
import struct
import subprocess
import sys

import pytest
import torch
from geartrain import plugins
from geartrain.config import RolloutConfig
from geartrain_sglang import cpu_ops, cpu_shims

#: a hang guard only, for a child process (a Python start-up importing torch, a make run):
#: far above what it takes on a loaded machine, so it never decides a test
HANG_GUARD_S = 600


def test_plugin_is_listed_with_its_version_and_capabilities() -> None:
    info = plugins.backend_info("rollout", "sglang")
    assert info.distribution == "geartrain-sglang" and info.version == "0.1.0"
    assert {"cpu", "cuda", "tensor_parallel", "release_memory", "lora"} <= set(info.capabilities)
    assert "update_adapter" in info.hooks
    assert {"build_rollout", "generate", "update_weights", "release", "resume", "shutdown"} <= set(info.hooks)


def test_options_are_validated_with_their_path() -> None:
    from geartrain.validation import validate_backend_sections
    from pydantic import BaseModel

    class Root(BaseModel):
        rollout: RolloutConfig

    root = Root(rollout=RolloutConfig(backend="sglang", options={"weight_sync": "pigeon", "nope": 1}))
    paths = {path for path, _ in validate_backend_sections(root)}
    assert paths == {"rollout.options.weight_sync", "rollout.options.nope"}


def test_importing_the_plugin_does_not_import_sglang() -> None:
    code = (
        "import sys, geartrain_sglang.plugin as p; p.capabilities(); p.config_schema(); print('sglang' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S, check=True)
    assert out.stdout.strip() == "False"


def _murmur3_32(data: bytes) -> int:
    """MurmurHash3 x86 32-bit, seed 0, straight from its definition."""
    h = 0
    for i in range(0, len(data), 4):
        k = struct.unpack("<I", data[i : i + 4])[0]
        k = (k * 0xCC9E2D51) & 0xFFFFFFFF
        k = ((k << 15) | (k >> 17)) & 0xFFFFFFFF
        k = (k * 0x1B873593) & 0xFFFFFFFF
        h ^= k
        h = ((h << 13) | (h >> 19)) & 0xFFFFFFFF
        h = (h * 5 + 0xE6546B64) & 0xFFFFFFFF
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_seeded_sampler_hash_is_murmur3() -> None:
    seeds = torch.tensor([0, 7, 2**40 + 5, 2**63 - 1])
    positions = torch.tensor([0, 3, 17, 2**31])
    cols = torch.arange(0, 300, 37)
    got = cpu_ops.murmur_hash32(seeds, positions, cols)
    for r, (s, p) in enumerate(zip(seeds.tolist(), positions.tolist(), strict=True)):
        expected = [
            _murmur3_32(struct.pack("<IIII", s & 0xFFFFFFFF, s >> 32, p & 0xFFFFFFFF, c)) for c in cols.tolist()
        ]
        assert got[r].tolist() == expected


def test_placeholders_stand_in_only_for_missing_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing shimmed package imports as a placeholder whose members fail when called;
    an installed one (here ``json``, declared shimmed for the test) is never shadowed."""
    monkeypatch.setattr(cpu_shims, "SHIMMED", ("geartrain_missing_pkg", "json"))
    finder = cpu_shims._Finder()
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, finder])
    for name in ("geartrain_missing_pkg", "geartrain_missing_pkg.sub"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module("geartrain_missing_pkg.sub")
    kernel = module.some_kernel
    with pytest.raises(cpu_shims.ShimCalled, match="some_kernel"):
        kernel(1, 2)

    class Derived(module.Base):  # placeholders may appear as base classes at import time
        pass

    with pytest.raises(cpu_shims.ShimCalled):
        Derived()
    assert finder.find_spec("json") is None
    import json

    assert json.dumps([1]) == "[1]"


def test_lora_modules_get_plain_host_buffers_for_pinned_ones_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's LoRA layers stage index tensors in pinned memory, which torch refuses without
    an accelerator; the patched module's factories drop ``pin_memory`` and
    ``Tensor.pin_memory()`` returns a plain copy. Other modules' ``torch`` is untouched."""
    import types

    if torch.accelerator.is_available():
        pytest.skip("the shim applies only without an accelerator")
    monkeypatch.setattr(torch.Tensor, "pin_memory", torch.Tensor.pin_memory)  # restored after the test
    monkeypatch.setattr(cpu_shims, "_pin_memory_replaced", False)
    with pytest.raises(RuntimeError):
        torch.tensor([1, 2], pin_memory=True)
    lora_layers = types.ModuleType("lora_layers")
    lora_layers.torch = torch
    cpu_shims._pinless(lora_layers)
    offsets = lora_layers.torch.tensor([0, 64, 96], dtype=torch.int32, device="cpu", pin_memory=True)
    assert offsets.tolist() == [0, 64, 96] and offsets.dtype == torch.int32
    assert lora_layers.torch.zeros((3,), dtype=torch.int32, pin_memory=True).tolist() == [0, 0, 0]
    assert lora_layers.torch.int32 is torch.int32 and lora_layers.torch.cumsum is torch.cumsum
    staged = offsets.pin_memory()
    assert staged.tolist() == offsets.tolist() and staged.data_ptr() != offsets.data_ptr()  # a copy, as pinning makes
    cpu_shims._pinless(lora_layers)  # idempotent
    assert isinstance(lora_layers.torch, cpu_shims._PinlessTorch) and lora_layers.torch._torch is torch
    with pytest.raises(RuntimeError):  # the real torch module keeps refusing
        torch.tensor([1, 2], pin_memory=True)
    assert set(cpu_shims.PATCHED_MODULES) >= {"sglang.srt.lora.layers", "sglang.srt.lora.backend.torch_backend"}
    for name in ("sglang.srt.lora.layers", "sglang.srt.lora.backend.torch_backend"):
        assert importlib.util.find_spec(name) is not None, f"{name} moved: the LoRA shim would not apply"


def test_cpu_engine_processes_start_with_the_configured_omp_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's processes inherit OMP_NUM_THREADS=cpu_threads (1 by default): SGLang's
    scheduler otherwise runs one OpenMP thread per core and stalls at op barriers whenever
    the machine is busy (bench/bench_sglang.py --contention)."""
    import sglang
    from geartrain_sglang import engine
    from geartrain_sglang.options import SglangOptions

    seen: list[str | None] = []

    class RecordingEngine:
        def __init__(self, **kwargs: object) -> None:
            seen.append(os.environ.get("OMP_NUM_THREADS"))  # what spawned children inherit

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(sglang, "Engine", RecordingEngine)
    assert SglangOptions().cpu_threads == 1
    engine.start_engine({}, "cpu", SglangOptions().cpu_threads)
    engine.start_engine({}, "cpu", 3)
    engine.start_engine({}, "cpu", None)  # torch's default in the children
    assert seen == ["1", "3", None]
    assert "OMP_NUM_THREADS" not in os.environ, "this process's own setting is left as it was"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # a user's own value wins
    engine.start_engine({}, "cpu", 1)
    assert seen[-1] == "2"


def test_engine_kwargs_that_geartrain_sets_itself_are_refused_naming_the_setting() -> None:
    """Issue 35, round 14 (as for vLLM): an ``engine_kwargs`` key geartrain sets from a setting
    of its own (``context_length``: ``rollout.max_model_len``) silently disagreed with it."""
    import pydantic
    from geartrain_sglang.options import SglangOptions

    with pytest.raises(pydantic.ValidationError, match=r"context_length \(set rollout.max_model_len\)"):
        SglangOptions(engine_kwargs={"context_length": 8})
    assert SglangOptions(engine_kwargs={"disable_radix_cache": True}).engine_kwargs == {"disable_radix_cache": True}
