"""Reward terms: one or several reward functions with weights, each per-sample or batched.

Two calling conventions are accepted:

* **per sample** (geartrain's own)::

      fn(response: str, ground_truth: str, *, prompt: str, meta: dict) -> float | dict

  called once per response; it may take fewer keywords (``(response, ground_truth)``).

* **batched** (TRL's)::

      fn(prompts: list[str], completions: list[str], **columns) -> list[float | dict]

  called once per batch with keyword arguments: ``prompts``, ``completions``,
  ``ground_truth`` (a list) and every other column of the data rows (each a list, one entry
  per response); it receives only the ones it names unless it takes ``**kwargs``. For a
  sample of a conversational row (``messages``, or a list of messages under ``prompt``)
  the shapes are TRL's: its prompt is that list of messages and its completion
  ``[{"role": "assistant", "content": text}]``; for a plain-prompt row both are strings.
  For multi-turn episodes it also gets ``environments`` (TRL's): each sample's environment
  as its episode left it (:class:`geartrain.agents.env_state.EnvironmentState`, its
  plain-data attributes), so ``[env.reward for env in environments]`` works as in TRL.
  During a run it also gets TRL's ``trainer_state`` (``global_step``, ``max_steps``,
  ``epoch``), ``completion_ids`` (each completion's token ids), ``log_metric(name, value)``
  (logged as ``reward/<name>``) and ``log_extra(column, values)`` (a column of
  ``completions.jsonl``): :class:`RewardContext`.

Either may be ``async def`` (TRL awaits async reward functions): each call then runs to
completion on an event loop of its own (:func:`awaited`); a batched one is awaited once per
batch, a per-sample one once per sample.

A function is batched when it says so (``reward.batched = true``, or a ``batched = True``
attribute, e.g. from :func:`batched_reward`) or when its first parameter is named
``prompts``, ``completions`` or ``environments``.

A score is a number, or a dict with a numeric ``score`` and optional numeric extras
(``acc``...) that become metrics, or ``None`` where the function does not apply to the
sample (TRL's convention). With several terms the reward of a sample is
``sum(weight x score)`` over the terms that returned a score and each term is logged on its
own (``reward/<name>/mean``, over the samples it scored).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from geartrain.agents.env_state import EnvironmentState
from geartrain.errors import GeartrainError
from geartrain.rewards.registry import get_reward

BATCHED_FIRST_PARAMS = ("prompts", "completions", "environments")


def batched_reward(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as a batched reward (``fn(prompts, completions, **columns) -> list``)
    whatever its parameters are called."""
    fn.batched = True  # type: ignore[attr-defined]
    return fn


def detect_batched(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` takes a batch: its ``batched`` attribute when set, else whether its
    first parameter is named ``prompts``, ``completions`` or ``environments`` (TRL's
    convention)."""
    declared = getattr(fn, "batched", None)
    if isinstance(declared, bool):
        return declared
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0].name in BATCHED_FIRST_PARAMS


def takes_environments(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` names an ``environments`` parameter (TRL's: the episodes' environments)."""
    try:
        return "environments" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def signature_problem(fn: Callable[..., Any], batched: bool) -> str | None:
    """Why ``fn`` cannot be called under its convention (``None`` when it can): a
    per-sample function must take two positional arguments and require nothing else; a
    batched one must accept a ``completions`` or ``environments`` keyword (the data's
    columns it names are checked when it is called, in ``geartrain check``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None  # builtins without a signature: the first call tells
    kinds = inspect.Parameter
    var_kw = any(p.kind is kinds.VAR_KEYWORD for p in params)
    if batched:
        names = {p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
        if not names & {"completions", "environments"} and not var_kw:
            return (
                "a batched reward is called as f(prompts=..., completions=..., **columns) but it takes no 'completions'"
            )
        return None
    positional = [p for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    var_pos = any(p.kind is kinds.VAR_POSITIONAL for p in params)
    if len(positional) < 2 and not var_pos:
        return (
            f"a per-sample reward is called as f(response, ground_truth, *, prompt, meta) but it takes "
            f"{len(positional)} positional parameter(s); a batched one must name its first parameter "
            "'prompts', 'completions' or 'environments'"
        )
    required = [p.name for p in positional[2:] if p.default is p.empty]
    required += [
        p.name
        for p in params
        if p.kind is kinds.KEYWORD_ONLY and p.default is p.empty and p.name not in ("prompt", "meta")
    ]
    if required:
        return f"it requires {required[0]!r}, which a per-sample reward is not given (it gets prompt= and meta=)"
    return None


@dataclass(frozen=True, slots=True)
class RewardTerm:
    """One reward function of a job, resolved: its metric ``name``, the callable, its
    ``weight`` in the sum and its calling convention."""

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    batched: bool = False
    truth_column: str = "ground_truth"
    """The data's ground-truth column (``data.ground_truth_key``): a batched function gets
    the ground truths under this name too, as TRL passes every column by its own name."""


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` returns a coroutine: an ``async def`` function, or an object
    whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def awaited(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A plain function that calls async ``fn`` and returns what its coroutine returns, run
    on a new event loop each call (rewards are called from worker threads, where no loop
    runs; in a thread that runs one, a notebook's, the coroutine gets a thread of its own).
    ``fn``'s signature and attributes (``batched``) stay visible (``__wrapped__``)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        coroutine = fn(*args, **kwargs)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the usual case: no loop in this thread
            return asyncio.run(coroutine)
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="geartrain-async-reward") as pool:
            return pool.submit(asyncio.run, coroutine).result()

    return run


def make_term(
    spec: Any,
    *,
    name: str | None = None,
    weight: float = 1.0,
    batched: bool | None = None,
    truth_column: str = "ground_truth",
) -> RewardTerm:
    """A :class:`RewardTerm` from anything :func:`~geartrain.rewards.get_reward` accepts
    (a batched function is taken as it is). Raises :class:`GeartrainError` naming the spec
    when it cannot be resolved or its signature does not fit its convention."""
    if isinstance(spec, RewardTerm):
        return spec
    raw = spec if callable(spec) else get_reward(spec)
    raw = getattr(raw, "__wrapped__", raw) if getattr(raw, "_geartrain_adapted", False) else raw
    is_batched = detect_batched(raw) if batched is None else batched
    label = name or (spec if isinstance(spec, str) else getattr(raw, "__name__", "reward"))
    problem = signature_problem(raw, is_batched)
    if problem:
        raise GeartrainError(f"reward function '{label}': {problem}")
    if is_async(raw):
        raw = awaited(raw)
    fn = raw if is_batched else get_reward(raw)
    return RewardTerm(name=str(label), fn=fn, weight=float(weight), batched=is_batched, truth_column=truth_column)


def as_terms(spec: Any) -> list[RewardTerm]:
    """The terms of ``spec``: a list of terms (or specs), or one spec (one term, weight 1)."""
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        return [make_term(s) for s in spec]
    return [make_term(spec)]


Messages = list[dict[str, str]]


@dataclass(frozen=True, slots=True)
class TrainerState:
    """What TRL's ``trainer_state`` gives reward functions for shaping by progress."""

    global_step: int
    """The step being scored (1-based, as TRL's after its first optimizer step)."""
    max_steps: int
    """``trainer.total_steps``."""
    epoch: float
    """Passes over the training data so far."""


@dataclass(slots=True)
class RewardContext:
    """TRL's run-time keyword arguments of batched reward functions, for one batch:
    ``trainer_state`` and ``completion_ids`` as given, and what the functions log through
    ``log_metric`` / ``log_extra`` collected in :attr:`metrics` / :attr:`columns`."""

    size: int
    """Completions in the batch."""
    trainer_state: TrainerState | None = None
    completion_ids: list[list[int]] | None = None
    metrics: dict[str, list[float]] = field(default_factory=dict)
    columns: dict[str, list[Any]] = field(default_factory=dict)

    def log_metric(self, name: str, value: float) -> None:
        """TRL's ``log_metric``: a number for this batch (averaged over the step)."""
        self.metrics.setdefault(str(name), []).append(float(value))

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        """TRL's ``log_extra``: one value per completion (text, a number, ``None``; anything
        else is logged as its ``str``), a column of the completions log."""
        values = list(values)
        if len(values) != self.size:
            raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values for {self.size} completions")
        self.columns[str(column)] = [
            v if v is None or isinstance(v, bool | int | float | str) else str(v) for v in values
        ]

    def keywords(self) -> dict[str, Any]:
        out: dict[str, Any] = {"log_metric": self.log_metric, "log_extra": self.log_extra}
        if self.trainer_state is not None:
            out["trainer_state"] = self.trainer_state
        if self.completion_ids is not None:
            out["completion_ids"] = self.completion_ids
        return out


def trl_shapes(
    prompts: Sequence[str],
    completions: Sequence[str],
    conversations: Sequence[Messages | None] | None,
    episodes: Sequence[Mapping[str, Any] | None] | None = None,
) -> tuple[list[str | Messages], list[str | Messages]]:
    """``prompts`` and ``completions`` as TRL's ``GRPOTrainer`` passes them to a reward
    function: for a sample whose row is a conversation (``conversations[i]`` its messages)
    the prompt is those messages and the completion ``[{"role": "assistant", "content":
    text}]``, or, for a multi-turn episode (``episodes[i]``, its
    :meth:`~geartrain.agents.Episode.record`), every turn after the prompt: the model's as
    ``assistant`` messages, the environment's as ``tool`` messages (as TRL's tool loop
    builds them); for a plain-prompt sample (``None``, or no ``conversations``) both stay text."""
    if conversations is None:
        return list(prompts), list(completions)
    shaped_prompts: list[str | Messages] = []
    shaped_completions: list[str | Messages] = []
    episodes = episodes if episodes is not None else [None] * len(completions)
    for prompt, completion, messages, episode in zip(prompts, completions, conversations, episodes, strict=True):
        if messages is None:
            shaped_prompts.append(prompt)
            shaped_completions.append(completion)
        elif episode is not None:
            shaped_prompts.append([dict(m) for m in messages])
            shaped_completions.append(
                [
                    {"role": "assistant" if t["role"] == "model" else "tool", "content": t["text"]}
                    for t in episode["turns"]
                ]
            )
        else:
            shaped_prompts.append([dict(m) for m in messages])
            shaped_completions.append([{"role": "assistant", "content": completion}])
    return shaped_prompts, shaped_completions


def call_batched(
    fn: Callable[..., Any],
    prompts: list[str],
    completions: list[str],
    truths: list[str],
    metas: list[dict[str, Any]],
    truth_column: str = "ground_truth",
    conversations: Sequence[Messages | None] | None = None,
    context: RewardContext | None = None,
) -> list[Any]:
    """Call a batched ``fn`` with the keywords it accepts: ``prompts``, ``completions``
    (TRL's message shapes for conversational samples: :func:`trl_shapes`),
    ``ground_truth`` (also as ``truth_column``, the data's own name for it), each data
    column (lists, one entry per response), ``environments`` for episodes and the run's
    ``context`` (:class:`RewardContext`)."""
    columns: dict[str, list[Any]] = {"ground_truth": list(truths), truth_column: list(truths)}
    for key in dict.fromkeys(k for m in metas for k in m):
        columns.setdefault(key, [m.get(key) for m in metas])
    episodes = [m.get("episode") if isinstance(m.get("episode"), Mapping) else None for m in metas]
    shaped_prompts, shaped_completions = trl_shapes(prompts, completions, conversations, episodes)
    kwargs: dict[str, Any] = {"prompts": shaped_prompts, "completions": shaped_completions, **columns}
    if context is not None:
        kwargs.update(context.keywords())
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = None
    if any(e is not None for e in episodes):  # TRL's environments: each episode's, as it ended
        kwargs["environments"] = [EnvironmentState(e.get("environment_state") if e else None) for e in episodes]
    elif params is not None and "environments" in params:
        raise TypeError(
            "it takes 'environments' (TRL's), which only multi-turn episodes have: set rollout.agent.environment"
        )
    if params is not None and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    out = fn(**kwargs)
    if hasattr(out, "tolist"):
        out = out.tolist()
    if not isinstance(out, Sequence) or isinstance(out, str | bytes) or len(out) != len(completions):
        what = f"{type(out).__name__} of length {len(out)}" if isinstance(out, Sequence) else type(out).__name__
        raise TypeError(
            f"a batched reward must return a list of {len(completions)} scores (one per completion), got {what}"
        )
    return list(out)
