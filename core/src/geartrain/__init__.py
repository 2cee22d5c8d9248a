"""geartrain: reinforcement-learning post-training for LLMs, with every backend a plugin.

The public API for users and plugin authors. Plugins import only from here,
:mod:`geartrain.hookspecs` and :mod:`geartrain.testing`.
"""

from geartrain.batch import Batch
from geartrain.checkpoint import CheckpointManager, load_state, save_state
from geartrain.config import EngineConfig, LoraConfig, ModelConfig, OptimConfig, ParallelConfig, RolloutConfig
from geartrain.dcp_guard import safe_dcp_reader, safe_load_planner
from geartrain.engine import Engine
from geartrain.errors import CheckpointError, ConfigError, DataError, GeartrainError, PluginError, PluginNotFoundError
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
