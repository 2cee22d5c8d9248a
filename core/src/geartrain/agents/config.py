"""``[rollout.agent]``: multi-turn episodes instead of one response per prompt."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from geartrain.limits import MAX_TIMEOUT_S


class AgentConfig(BaseModel):
    """How the rollout runs episodes (see docs/agents.md). Set ``environment`` to turn a
    job into an agentic one."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True, allow_inf_nan=False
    )

    environment: str | dict[str, str]
    """The environment class: ``my_env.py:Calculator`` (relative to the job file),
    ``package.module:Class``, or the built-in ``tools`` (a tool environment configured by
    ``environment_kwargs``: ``tools``, ``call_format``, ``timeout_s``). Or a table of named
    environments, ``{ math = "envs.py:Math", search = "envs.py:Search" }``: each data row
    names its own in its ``environment_key`` column (TRL's dict ``environment_factory``)."""
    environment_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment class, for every episode. With a table of
    environments, a table per name (``{ math = { digits = 3 } }``; a name left out gets none)."""
    environment_key: str = "environment"
    """With a table of environments: the data column naming each row's environment. The
    column is not passed to ``reset`` (TRL's control field)."""
    max_turns: int = Field(4, ge=1)
    """Most model turns per episode; the episode ends after that many (``max_turns``)."""
    max_tokens_per_turn: int | None = Field(None, ge=1)
    """Most tokens of one model turn; default: ``sampling.max_tokens``."""
    max_episode_tokens: int | None = Field(None, ge=1)
    """Most tokens after the task prompt (model turns and observations together); an
    episode that reaches it is truncated and marked. Default: what ``rollout.max_model_len``
    leaves after the prompt."""
    stop_texts: list[str] = Field(default_factory=list)
    """Texts that end a model turn, besides the environment's own (a tool environment's
    call closer) and the EOS token."""
    chat_template: bool = False
    """Render observations as turns of the tokenizer's chat template (the template's
    "bridge" tokens are masked like the observation); false: append them as plain text."""
    observation_role: str = "tool"
    """Role of an observation turn under the chat template."""
    workers: int = Field(32, ge=1)
    """Threads that run environment steps (tool calls) while the model generates."""
    step_timeout_s: float | None = Field(300.0, gt=0, le=MAX_TIMEOUT_S)
    """Seconds one ``reset``, ``step`` or ``close`` of an environment may take: past it the episode
    ends as an error ("timed out") and the others go on (the call is left running on a
    daemon thread: Python cannot stop a thread). ``None``: no limit."""

    @model_validator(mode="after")
    def _named_environments(self) -> AgentConfig:
        if not isinstance(self.environment, dict):
            return self
        if not self.environment:
            raise ValueError("rollout.agent.environment: the table of environments is empty; name at least one")
        unknown = [k for k in self.environment_kwargs if k not in self.environment]
        if unknown:
            raise ValueError(
                f"rollout.agent.environment_kwargs: {', '.join(map(repr, unknown))} is not an environment of "
                f"rollout.agent.environment ({', '.join(self.environment)}); with a table of environments, "
                "environment_kwargs holds a table per environment name"
            )
        loose = [k for k, v in self.environment_kwargs.items() if not isinstance(v, dict)]
        if loose:
            raise ValueError(
                f"rollout.agent.environment_kwargs.{loose[0]} must be a table of keyword arguments, "
                f"got {type(self.environment_kwargs[loose[0]]).__name__}"
            )
        return self
