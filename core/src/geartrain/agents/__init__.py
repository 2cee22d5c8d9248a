"""Multi-turn agentic episodes: environments, tools, token-in/token-out trajectories and the
asynchronous episode runner (see docs/agents.md).

* :mod:`~geartrain.agents.environment` — the protocol (``reset(task)``, ``step(action)``);
* :mod:`~geartrain.agents.loading` — ``rollout.agent.environment`` to a factory;
* :mod:`~geartrain.agents.tools` — tools with JSON-schema arguments, the tool environment;
* :mod:`~geartrain.agents.formats` — tool-call formats (``hermes``, ``compact``), chat bridges;
* :mod:`~geartrain.agents.trajectory` — an episode as token ids, and its training row;
* :mod:`~geartrain.agents.runner` — the asynchronous scheduler;
* :mod:`~geartrain.agents.trl_environment` — TRL ``environment_factory`` classes, unchanged;
* :mod:`~geartrain.agents.env_state` — what reward functions get as TRL's ``environments``;
* :mod:`~geartrain.agents.config` — ``[rollout.agent]``.
"""

from geartrain.agents.config import AgentConfig
from geartrain.agents.environment import Environment, EnvironmentFactory, StepResult
from geartrain.agents.formats import (
    CallFormat,
    CompactFormat,
    HermesFormat,
    ToolCall,
    ToolOutcome,
    chat_bridge,
    get_call_format,
)
from geartrain.agents.loading import EnvironmentRouter, load_environment, load_environments
from geartrain.agents.runner import TURN_STRIDE, EpisodeRunner, RunnerLimits, episode_metrics
from geartrain.agents.tools import Tool, ToolEnvironment, run_with_timeout, schema_of, tool
from geartrain.agents.trajectory import Episode, Segment, episode_batch
from geartrain.agents.trl_environment import TRLEnvironment

__all__ = [
    "TURN_STRIDE",
    "AgentConfig",
    "CallFormat",
    "CompactFormat",
    "Environment",
    "EnvironmentFactory",
    "EnvironmentRouter",
    "Episode",
    "EpisodeRunner",
    "HermesFormat",
    "RunnerLimits",
    "Segment",
    "StepResult",
    "Tool",
    "ToolCall",
    "TRLEnvironment",
    "ToolEnvironment",
    "ToolOutcome",
    "chat_bridge",
    "episode_batch",
    "episode_metrics",
    "get_call_format",
    "load_environment",
    "load_environments",
    "run_with_timeout",
    "schema_of",
    "tool",
]
