"""``[rollout.agent]``: multi-turn episodes instead of one response per prompt."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class AgentConfig(BaseModel):
    """How the rollout runs episodes (see docs/agents.md). Set ``environment`` to turn a
    job into an agentic one."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    environment: str
    """The environment class: ``my_env.py:Calculator`` (relative to the job file),
    ``package.module:Class``, or the built-in ``tools`` (a tool environment configured by
    ``environment_kwargs``: ``tools``, ``call_format``, ``timeout_s``)."""
    environment_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment class, for every episode."""
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
    step_timeout_s: float | None = Field(300.0, gt=0)
    """Seconds one ``reset`` or ``step`` of an environment may take: past it the episode
    ends as an error ("timed out") and the others go on (the call is left running on a
    daemon thread: Python cannot stop a thread). ``None``: no limit."""
