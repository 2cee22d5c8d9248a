"""The environment protocol of multi-turn episodes (in the spirit of Gymnasium / OpenEnv).

One :class:`Environment` object serves one episode::

    env = factory()                       # an object for this episode alone
    first = env.reset(task)               # text appended after the task prompt ("" for none)
    while not done:
        action = <the model's turn, decoded>
        result = env.step(action)         # StepResult(observation, reward, done, info)
    env.close()

``task`` is the data row: ``{"prompt", "ground_truth", **meta}``. ``result.observation`` is
text the runner tokenizes once and appends after the model's turn (its tokens are masked
out of the loss); ``result.reward`` is this turn's reward, placed on the last token of the
model's turn; ``done`` ends the episode (its final reward then comes from the job's reward
function, which may read the whole episode). ``step`` runs on a worker thread, so a slow
environment holds up only its own episode.

Optional: ``final_reward()`` scores the whole episode once it ends (done, ``max_turns`` or
truncated; added to its last model turn's reward), and ``reset_extends_prompt = True``
appends ``reset``'s text to the prompt's last user message instead of observing it. A TRL
``environment_factory`` class (``reset`` and tool methods, no ``step``) is run through
:class:`geartrain.agents.trl_environment.TRLEnvironment`, which uses both.

An environment is named in the job file like a reward function::

    [rollout.agent]
    environment = "my_env.py:Calculator"      # or "package.module:Calculator"
    environment_kwargs = { digits = 3 }       # passed to the class for every episode
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Environment", "EnvironmentFactory", "StepResult"]


@dataclass(kw_only=True, slots=True)
class StepResult:
    """What one ``step`` returns."""

    observation: str | Sequence[str] | None = None
    """Text shown to the model before its next turn; ``None`` or ``""``: nothing. A list
    is several messages (one chat-template turn each, e.g. one per tool result; joined
    when observations are plain text)."""
    reward: float = 0.0
    """This turn's reward (placed on the last token of the model's turn)."""
    done: bool = False
    """The episode is over (no observation is appended then)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything to keep with the episode (tool calls, errors...). The runner counts
    ``info["tool_calls"]``, ``info["tool_errors"]`` and ``info["tool_latencies_s"]``."""


class Environment:
    """Base class of environments (subclassing it is optional: any object with ``reset``
    and ``step`` works). ``tools`` lists JSON-schema tool specs a chat template may show
    the model; ``close`` releases what the episode held."""

    tools: Sequence[Mapping[str, Any]] = ()
    stop_texts: Sequence[str] = ()
    """Texts that end a model turn (the runner stops generation right after one)."""

    def reset(self, task: Mapping[str, Any]) -> str:
        """Start an episode on ``task``; return the first observation ("" for none)."""
        return ""

    def step(self, action: str) -> StepResult:
        """React to the model's turn ``action`` (its decoded text)."""
        raise NotImplementedError

    def close(self) -> None:
        """Called once when the episode ends."""


EnvironmentFactory = Callable[[], Any]
"""A callable returning an environment for one episode (no other episode uses it until
its ``close``; TRL environments are pooled and reused after it)."""
