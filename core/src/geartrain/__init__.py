"""geartrain: reinforcement-learning post-training for LLMs, with every backend a plugin.

The public API for users and plugin authors. Plugins import only from here,
:mod:`geartrain.hookspecs` and :mod:`geartrain.testing`.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names below are imported on first use (``geartrain --help`` stays fast)
    from geartrain.batch import Batch
    from geartrain.checkpoint import CheckpointManager, load_state, save_state
    from geartrain.config import EngineConfig, LoraConfig, ModelConfig, OptimConfig, ParallelConfig, RolloutConfig
    from geartrain.dcp_guard import safe_dcp_reader, safe_load_planner
    from geartrain.engine import Engine
    from geartrain.errors import (
        CheckpointError,
        ConfigError,
        DataError,
        GeartrainError,
        PluginError,
        PluginNotFoundError,
    )
    from geartrain.hookspecs import hookimpl
    from geartrain.plugins import list_plugins, register_engine, register_extension, register_rollout
    from geartrain.rollout import Rollout
    from geartrain.types import (
        AdapterReceiver,
        Capability,
        DataParallelCoordinates,
        EngineContext,
        LossContext,
        LossFn,
        MemoryStats,
        SamplingParams,
        StepOutput,
        SyncStats,
        WeightReceiver,
    )
    from geartrain.validation import load_config

#: Public name -> the module that defines it; imported on first access (PEP 562), so
#: ``import geartrain`` (and the CLI) does not pull torch until something needs it.
_EXPORTS: dict[str, str] = {
    "AdapterReceiver": "geartrain.types",
    "Batch": "geartrain.batch",
    "Capability": "geartrain.types",
    "CheckpointError": "geartrain.errors",
    "CheckpointManager": "geartrain.checkpoint",
    "ConfigError": "geartrain.errors",
    "DataError": "geartrain.errors",
    "DataParallelCoordinates": "geartrain.types",
    "Engine": "geartrain.engine",
    "EngineConfig": "geartrain.config",
    "EngineContext": "geartrain.types",
    "GeartrainError": "geartrain.errors",
    "LoraConfig": "geartrain.config",
    "LossContext": "geartrain.types",
    "LossFn": "geartrain.types",
    "MemoryStats": "geartrain.types",
    "ModelConfig": "geartrain.config",
    "OptimConfig": "geartrain.config",
    "ParallelConfig": "geartrain.config",
    "PluginError": "geartrain.errors",
    "PluginNotFoundError": "geartrain.errors",
    "Rollout": "geartrain.rollout",
    "RolloutConfig": "geartrain.config",
    "SamplingParams": "geartrain.types",
    "StepOutput": "geartrain.types",
    "SyncStats": "geartrain.types",
    "WeightReceiver": "geartrain.types",
    "hookimpl": "geartrain.hookspecs",
    "list_plugins": "geartrain.plugins",
    "load_config": "geartrain.validation",
    "load_state": "geartrain.checkpoint",
    "register_engine": "geartrain.plugins",
    "register_extension": "geartrain.plugins",
    "register_rollout": "geartrain.plugins",
    "safe_dcp_reader": "geartrain.dcp_guard",
    "safe_load_planner": "geartrain.dcp_guard",
    "save_state": "geartrain.checkpoint",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'geartrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__version__ = "0.1.0"

__all__ = [
    "AdapterReceiver",
    "Batch",
    "Capability",
    "CheckpointError",
    "CheckpointManager",
    "ConfigError",
    "DataError",
    "DataParallelCoordinates",
    "Engine",
    "EngineConfig",
    "EngineContext",
    "GeartrainError",
    "LoraConfig",
    "LossContext",
    "LossFn",
    "MemoryStats",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PluginError",
    "PluginNotFoundError",
    "Rollout",
    "RolloutConfig",
    "SamplingParams",
    "StepOutput",
    "SyncStats",
    "WeightReceiver",
    "hookimpl",
    "list_plugins",
    "load_config",
    "load_state",
    "register_engine",
    "register_extension",
    "register_rollout",
    "safe_dcp_reader",
    "safe_load_planner",
    "save_state",
]
