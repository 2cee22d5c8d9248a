"""The megatron engine does not train LoRA adapters (megatron-core has none of its own):
``actor.lora`` with it is refused when the configuration is loaded, before any rank starts,
and the error names the engine that does (fsdp)."""

from __future__ import annotations

import pytest
from geartrain.errors import ConfigError
from geartrain.trainer.config import load_train_config


def test_actor_lora_on_the_megatron_engine_is_refused_naming_fsdp() -> None:
    with pytest.raises(ConfigError) as err:
        load_train_config(None, ["actor.engine.backend=megatron", "actor.lora.rank=16"])
    problem = dict(err.value.problems)["actor.engine.lora"]
    assert "'megatron' engine does not support LoRA adapters" in problem
    assert "'fsdp' engine" in problem and 'actor.engine.backend = "fsdp"' in problem
