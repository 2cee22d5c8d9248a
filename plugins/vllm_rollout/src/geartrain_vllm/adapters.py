"""LoRA adapters in vLLM (``update_adapter``): the engine is started with ``enable_lora``, and
each synced adapter becomes a new ``LoRARequest`` that every later ``generate`` carries.

vLLM's ``LoRARequest`` (vllm/lora/request.py) names an adapter by a *path* only: its worker
reads ``adapter_config.json`` + ``adapter_model.safetensors`` from there
(``LoRAModel.from_local_checkpoint``); there is no public way to hand it tensors. So the
adapter is written as a PEFT directory under ``/dev/shm`` (memory-backed: no disk round trip)
where it exists, and loaded under a fresh adapter id each sync (the previous id is removed),
which also keeps vLLM's prefix cache from serving blocks computed under the old adapter.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from geartrain.errors import GeartrainError

#: The ranks vLLM accepts for ``max_lora_rank`` (vllm/config/lora.py, ``MaxLoRARanks``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise GeartrainError(f"vllm rollout: LoRA rank {rank} exceeds vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})")


def lora_engine_kwargs(max_rank: int) -> dict[str, Any]:
    """``vllm.LLM`` arguments that enable one LoRA adapter of rank up to ``max_rank``."""
    return {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(max_rank), "max_loras": 1}


def adapter_root() -> Path:
    """Where adapter directories are written: memory-backed ``/dev/shm`` when there is one."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() else None
    return Path(tempfile.mkdtemp(prefix="geartrain-vllm-lora-", dir=base))


@dataclass
class ServedAdapter:
    """The adapter every ``generate`` uses: its vLLM request and its directory."""

    name: str
    lora_id: int
    path: Path
    request: Any


class AdapterSlot:
    """One active adapter of a ``vllm.LLM``: written, loaded, replaced, reloaded after restart."""

    def __init__(self, max_rank: int | None) -> None:
        self.max_rank = max_rank
        self.root: Path | None = None
        self.served: ServedAdapter | None = None
        self._next_id = 1

    def update(self, llm: Any, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        """Write the adapter, load it under a new id (``llm`` may be ``None`` while a CPU
        engine is released: it is loaded at resume), and drop the previous one."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if self.max_rank is None:
            raise GeartrainError(
                "vllm rollout: update_adapter needs rollout.max_lora_rank (the engine starts without LoRA)"
            )
        rank = int(config["r"])
        if rank > self.max_rank:
            raise GeartrainError(f"vllm rollout: adapter rank {rank} exceeds rollout.max_lora_rank ({self.max_rank})")
        if self.root is None:
            self.root = adapter_root()
        lora_id, self._next_id = self._next_id, self._next_id + 1
        path = self.root / f"{name}-{lora_id}"
        path.mkdir(parents=True)
        (path / "adapter_config.json").write_text(json.dumps(config))
        save_file(
            {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors")
        )
        served = ServedAdapter(
            name, lora_id, path, LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=str(path))
        )
        previous, self.served = self.served, served
        if llm is not None:
            llm.llm_engine.add_lora(served.request)  # loaded now: a bad adapter fails here, not in generate
        if previous is not None:
            if llm is not None:
                llm.llm_engine.remove_lora(previous.lora_id)
            shutil.rmtree(previous.path, ignore_errors=True)

    def reload(self, llm: Any) -> None:
        """Load the served adapter into a restarted engine."""
        if self.served is not None:
            llm.llm_engine.add_lora(self.served.request)

    @property
    def request(self) -> Any:
        """The ``lora_request`` of ``generate`` (``None``: the base model)."""
        return self.served.request if self.served is not None else None

    def clear(self) -> None:
        self.served = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
