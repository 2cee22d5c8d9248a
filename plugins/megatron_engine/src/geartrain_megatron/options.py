"""The megatron engine's own options section (``[actor.engine.options]``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class MegatronOptions(BaseModel):
    """Options of the ``megatron`` engine backend; validated by the core via ``config_schema``."""

    model_config = ConfigDict(extra="forbid")

    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """Layer implementation: megatron's own modules (``local``, works everywhere) or
    TransformerEngine's (``transformer_engine``, GPU). ``auto``: TransformerEngine when it
    is importable and a GPU is present, else local."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state (and the fp32 main weights) over data-parallel ranks
    (megatron's distributed optimizer)."""
