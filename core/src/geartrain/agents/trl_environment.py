"""TRL's ``environment_factory`` environments, run unchanged as geartrain environments.

TRL's ``GRPOTrainer(environment_factory=MyEnv)`` takes a class whose public methods are
the tools the model may call, with ``reset(**row)`` (the dataset row's columns as keyword
arguments; a returned string is appended to the last user message) and an optional
``get_reward()`` (the environment's score of the finished rollout, one more reward source
of weight 1). :class:`TRLEnvironment` wraps one instance per episode as a
:class:`~geartrain.agents.tools.ToolEnvironment` with the same contract:

* tools: every function defined on the class except ``reset``, ``get_reward`` and names
  starting with ``_`` (TRL's rule), bound to the episode's instance; their specs are
  :func:`~geartrain.agents.tools.tool_of_function`'s (``get_json_schema``, what TRL's chat
  template renders); ``async`` methods run to completion on the tool's thread;
* calls in the ``hermes`` format (``<tool_call>{...}</tool_call>``, what Qwen's and
  Llama's templates and TRL's parser use), a turn's calls run one after another in order;
  a turn without a call ends the episode;
* ``reset`` gets the row as TRL passes it (:func:`trl_row`); its string is appended to the
  last user message of the prompt (``reset_extends_prompt``, done by the runner);
* ``get_reward`` becomes :meth:`final_reward`, which the runner calls once when the episode
  ends (done, ``max_turns`` or truncated; not after an error) and adds to the last model
  turn's reward.

Instances are pooled as TRL pools them ("construct once, reset often"): an episode takes
an idle instance (built with the factory's arguments only when none is idle, so a rank
builds as many as it runs episodes at once) and gives it back when it ends. An instance
still busy when its episode ends (a ``reset`` or tool call that outran
``rollout.agent.step_timeout_s`` goes on running on its thread) is dropped, never reused.

What differs from TRL: a reward function's ``environments`` are snapshots of the
instances' plain-data attributes taken when their episodes ended
(:mod:`geartrain.agents.env_state`), since the instances live on the rollout ranks.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from geartrain.agents.environment import Environment
from geartrain.agents.tools import ToolEnvironment, run_sync, tool_of_function

__all__ = ["TRLEnvironment", "TRLEnvironmentPool", "is_trl_environment", "trl_row"]

_NOT_TOOLS = ("reset", "get_reward")


def is_trl_environment(cls: Any) -> bool:
    """Whether ``cls`` is a TRL ``environment_factory`` class: a ``reset`` and no ``step``,
    or a ``step`` (then one of its tools) beside a ``reset`` that cannot take the task as a
    positional argument (TRL calls ``reset(**row)``; a geartrain environment's is
    ``reset(task)``)."""
    if not isinstance(cls, type) or not callable(getattr(cls, "reset", None)):
        return False
    if getattr(cls, "step", None) is None:
        return True
    return not issubclass(cls, Environment) and not _takes_a_task(cls)


def _takes_a_task(cls: type) -> bool:
    # (self, task) of a plain method; (task) of a static or class method
    bound = isinstance(inspect.getattr_static(cls, "reset", None), staticmethod | classmethod)
    try:
        inspect.signature(cls.reset).bind(*(() if bound else (None,)), {})
    except TypeError:
        return False
    except ValueError:  # no signature to read: as before, a geartrain environment
        return True
    return True


def trl_row(task: Mapping[str, Any]) -> dict[str, Any]:
    """``reset``'s keyword arguments for a geartrain task: the data row's columns as TRL
    passes them. A conversational prompt is the message list (``prompt_messages``), a
    plain one the prompt text; the ground truth is under its column's name where the task
    says it (``ground_truth_column``) and ``ground_truth`` otherwise, as the row holds it
    (``ground_truth_value``: a number stays one) where the task has it."""
    hidden = ("prompt_messages", "ground_truth_column", "ground_truth", "ground_truth_value")
    row = {k: v for k, v in task.items() if k not in hidden}
    if task.get("prompt_messages") is not None:
        row["prompt"] = [dict(m) for m in task["prompt_messages"]]
    if task.get("ground_truth") is not None:
        value = task.get("ground_truth_value")
        row[task.get("ground_truth_column") or "ground_truth"] = task["ground_truth"] if value is None else value
    return row


class TRLEnvironment(ToolEnvironment):
    """One episode of a TRL ``environment_factory`` environment ``instance`` (see the
    module docstring). ``close`` gives it back to ``pool`` (when one is given) unless one
    of its calls is still running."""

    reset_extends_prompt = True
    """The runner appends ``reset``'s string to the prompt's last user message."""

    def __init__(self, instance: Any, pool: TRLEnvironmentPool | None = None) -> None:
        self.instance = instance
        self.pool = pool
        self._lock = threading.Lock()
        self._running = 0  # calls into the instance not returned yet
        self._leased = pool is not None
        methods = [
            getattr(instance, name)
            for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in _NOT_TOOLS and not name.startswith("_")
        ]
        # no per-call limit: rollout.agent.step_timeout_s bounds the whole step, as TRL has none
        # the methods share the instance's state: a turn's calls run in order, as TRL runs them;
        # every one of them (TRL has no limit per turn)
        super().__init__(
            [tool_of_function(m) for m in methods],
            call_format="hermes",
            timeout_s=None,
            max_calls_per_turn=sys.maxsize,
            concurrent_calls=False,
        )

    def _calling(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self._running += 1
        try:
            return fn(*args, **kwargs)
        finally:
            with self._lock:
                self._running -= 1

    def reset(self, task: Mapping[str, Any]) -> str:
        observation = self._calling(run_sync(self.instance.reset), **trl_row(task))
        return "" if observation is None else observation

    def step(self, action: str) -> Any:
        return self._calling(super().step, action)

    def final_reward(self) -> Any:
        """``get_reward()`` of the instance, or ``None`` when it has none. The runner takes
        any finite number, as TRL does (a bool, a numpy scalar); anything else ends the
        episode as an error."""
        get_reward = getattr(self.instance, "get_reward", None)
        return None if get_reward is None else self._calling(run_sync(get_reward))

    def close(self) -> None:
        """The episode is over: back to the pool, once, if nothing of it still runs."""
        with self._lock:
            leased, self._leased = self._leased, False
            idle = self._running == 0
        if leased and idle and self.pool is not None:
            self.pool.give_back(self)


class TRLEnvironmentPool:
    """A factory of :class:`TRLEnvironment` episodes over reused instances of ``cls``
    (built as ``cls(**kwargs)``): TRL's "construct once, reset often". Thread-safe: the
    runner starts and ends episodes on its worker threads."""

    def __init__(self, cls: Callable[..., Any], kwargs: Mapping[str, Any] | None = None) -> None:
        self.cls = cls
        self.kwargs = dict(kwargs or {})
        self._idle: list[TRLEnvironment] = []
        self._lock = threading.Lock()
        self.built = 0
        """Instances built so far (at most the most episodes run at once, plus any dropped)."""

    def __call__(self) -> TRLEnvironment:
        with self._lock:
            if self._idle:
                env = self._idle.pop()
                env._leased = True
                return env
            self.built += 1
        return TRLEnvironment(self.cls(**self.kwargs), pool=self)

    def give_back(self, env: TRLEnvironment) -> None:
        with self._lock:
            self._idle.append(env)
