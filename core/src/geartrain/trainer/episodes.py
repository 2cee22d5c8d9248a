"""Multi-turn episodes in the trainer (``[rollout.agent]``).

* :func:`run_episode_share` — on a rollout rank: this rank's data-parallel share of the
  step's tasks, ``n`` episodes each, through :class:`geartrain.agents.EpisodeRunner` on the
  rank's rollout; returns the episodes as masked rollout rows
  (:func:`geartrain.agents.episode_batch`).
* :func:`episode_prompt_batch` — on the driver: the prompts of a step with the task each
  episode's environment is reset with, ready for ``Dispatch.DP``.
* :func:`annotate_episodes` — on the driver: what the rest of the step reads. The reward
  function gets the last model turn as ``response`` and the whole episode as
  ``meta["episode"]`` (turns, tool calls, rewards; see :meth:`geartrain.agents.Episode.record`).

Episode ``j`` of the task with step index ``i`` has the global index ``i * n + j``, which keys
its sampling streams, so a step's episodes are the same on 1 or N ranks; its GRPO group is
its task.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from geartrain.agents import AgentConfig, EpisodeRunner, RunnerLimits, episode_batch, episode_metrics, load_environments
from geartrain.batch import Batch
from geartrain.cluster import Dispatch, WorkerGroup
from geartrain.cluster.dispatch import prompt_batch
from geartrain.data import PromptBatch
from geartrain.trainer.config import TrainConfig
from geartrain.trainer.generation import Generation
from geartrain.types import SamplingParams

logger = logging.getLogger("geartrain.agents")

__all__ = [
    "EpisodeGeneration",
    "annotate_episodes",
    "episode_prompt_batch",
    "generate_episodes",
    "log_sample",
    "render_sample",
    "run_episode_share",
]


def episode_prompt_batch(prompts: PromptBatch, ground_truth_column: str | None = None) -> Batch:
    """``prompt_batch`` of the prompts plus each one's ``task`` for the environment's
    ``reset``: ``prompt`` (the rendered text), ``ground_truth``, the row's other fields,
    and, for a TRL environment's row (:func:`geartrain.agents.trl_environment.trl_row`),
    ``prompt_messages`` (a conversational row's messages), ``ground_truth_column``
    (``data.ground_truth_key``) and ``ground_truth_value`` (the row's value, a number
    where it is one)."""
    batch = prompt_batch(prompts.prompt_ids)
    tasks = []
    for r in prompts.rows:
        task = {**dict(r.meta), "prompt": r.prompt, "ground_truth": r.ground_truth}
        if r.messages is not None:
            task["prompt_messages"] = [dict(m) for m in r.messages]
        if ground_truth_column is not None:
            task["ground_truth_column"] = ground_truth_column
            task["ground_truth_value"] = r.ground_truth_value
        tasks.append(task)
    batch.meta["task"] = tasks
    return batch


def run_episode_share(
    generate: Any,
    tokenizer: Any,
    prompts: Batch,
    sampling: SamplingParams,
    agent: AgentConfig,
    *,
    base_dir: str | None,
    max_model_len: int,
    rank: int = 0,
) -> tuple[Batch, dict[str, float]]:
    """``sampling.n`` episodes of each task in ``prompts`` (a share of
    :func:`episode_prompt_batch`), prompt-major, generated with ``generate``."""
    n = sampling.n
    factory = _factory(
        json.dumps(agent.environment, sort_keys=True),
        json.dumps(agent.environment_kwargs, sort_keys=True, default=str),
        agent.environment_key,
        base_dir,
    )
    limits = RunnerLimits(
        max_turns=agent.max_turns,
        max_tokens_per_turn=agent.max_tokens_per_turn or sampling.max_tokens,
        max_episode_tokens=agent.max_episode_tokens,
        max_model_len=max_model_len,
    )
    runner = EpisodeRunner(
        generate,
        tokenizer,
        factory,
        limits,
        # sampling.stop (its encodings in sampling.stop_sequences) ends a turn, matched on
        # text too, as it ends a single-turn sample (Generation.annotate)
        stop_texts=[*agent.stop_texts, *(tokenizer.decode(list(s)) for s in sampling.stop_sequences)],
        chat_template=agent.chat_template,
        observation_role=agent.observation_role,
        workers=agent.workers,
        step_timeout_s=agent.step_timeout_s,
        said=_said(id(factory)),
    )
    ids, index, tasks = prompts["prompt_ids"], prompts["prompt_index"], prompts["task"]
    rows = [(i, j) for i in range(len(ids)) for j in range(n)]
    episodes, metrics = runner.run(
        [ids[i] for i, _ in rows],
        [tasks[i] for i, _ in rows],
        dataclasses.replace(sampling, n=1, prompt_indices=None),
        episode_indices=[index[i] * n + j for i, j in rows],
        groups=[index[i] for i, _ in rows],
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = episode_batch(episodes, pad, meta={"rollout_rank": [rank] * len(episodes)})
    return batch, metrics


@functools.lru_cache(maxsize=8)
def _said(factory_id: int) -> set[str]:
    """The notes said once for the environment factory ``factory_id`` (one per job's
    environment, see :func:`_factory`) in this process: shared by every step's runner."""
    return set()


@functools.lru_cache(maxsize=8)
def _factory(environment_json: str, kwargs_json: str, key: str, base_dir: str | None) -> Any:
    """The environment factory (or router), resolved once per rank: a ``file.py`` is
    imported once, and TRL environments' pools live across steps."""
    return load_environments(json.loads(environment_json), kwargs=json.loads(kwargs_json), key=key, base_dir=base_dir)


def annotate_episodes(batch: Batch, prompts: PromptBatch, n: int) -> tuple[Batch, dict[str, float]]:
    """Add the prompts' per-sample metadata; ``response_text`` is each episode's last model
    turn and ``data_meta["episode"]`` its record. Returns the batch and the step's agent
    metrics (:func:`geartrain.agents.episode_metrics`)."""
    for key, values in prompts.sample_meta(n).items():
        batch[key] = values
    records = batch["episode"]
    extended = [row for row, r in enumerate(records) if r.get("prompt_extension")]
    if extended:  # reset's text joined the last user message: rewards see the prompt the model saw
        batch["prompt"] = [records[row]["prompt"] if row in extended else p for row, p in enumerate(batch["prompt"])]
        if "prompt_messages" in batch.meta:
            batch["prompt_messages"] = [
                _extend_last_user(m, records[row]["prompt_extension"]) if row in extended and m else m
                for row, m in enumerate(batch["prompt_messages"])
            ]
    batch["response_text"] = [_final_text(r) for r in records]
    batch["data_meta"] = [{**dict(m or {}), "episode": r} for m, r in zip(batch["data_meta"], records, strict=True)]
    return batch, episode_metrics(records)


def _extend_last_user(messages: Sequence[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    out = [dict(m) for m in messages]
    last = max((i for i, m in enumerate(out) if m.get("role") == "user"), default=None)
    if last is not None:
        out[last]["content"] = out[last]["content"] + text
    return out


def generate_episodes(
    actor: WorkerGroup, config: TrainConfig, prompts: PromptBatch, sampling: SamplingParams
) -> tuple[Batch, dict[str, float]]:
    """The RL step's rollout when ``rollout.agent`` is set: ``sampling.n`` episodes of each
    of ``prompts`` on the actor group's ranks (``Dispatch.DP``), annotated, with the
    rollout's and the episodes' metrics."""
    assert config.rollout.agent is not None
    batch, metrics = actor.call(
        "run_episodes",
        episode_prompt_batch(prompts, config.data.ground_truth_key),
        sampling,
        config.rollout.agent,
        config.base_dir,
        dispatch=Dispatch.DP,
    )
    batch, agent_metrics = annotate_episodes(batch, prompts, sampling.n)
    for line in failure_lines(batch["episode"]):
        logger.warning("%s", line)
    return batch, {**metrics, **agent_metrics}


def failure_lines(records: Sequence[dict[str, Any]]) -> list[str]:
    """One console line per kind of failure in a step's episode records
    (:meth:`geartrain.agents.Episode.record`), as failing reward functions get: episodes
    that ended as an environment error, by the error's kind (``ValueError``, ``step
    returned int``, ...), and failed tool calls, by tool; each with how many of the step's
    episodes (calls) it hit and its first message."""
    errors: dict[str, list[str]] = {}
    for r in records:
        if r.get("finish") == "error":
            message = str(r.get("error") or "")
            errors.setdefault(_error_kind(message), []).append(message)
    calls = [c for r in records for c in r.get("calls", [])]
    failed: dict[str, list[str]] = {}
    for c in calls:
        if not c.get("ok", True):
            failed.setdefault(str(c.get("name") or "?"), []).append(str(c.get("result", "")))
    lines = [
        f"environment error in {len(messages)} of {len(records)} episodes ({kind}; agent/env_errors): "
        f"{messages[0][:300]}"
        for kind, messages in errors.items()
    ]
    for name, results in failed.items():
        total = sum(str(c.get("name") or "?") == name for c in calls)
        lines.append(
            f"tool {name!r} failed {len(results)} of its {total} calls (agent/tool_errors); first: {results[0][:300]}"
        )
    return lines


def _error_kind(message: str) -> str:
    """An episode error's kind: the exception's name (``ValueError: ...``) or the words
    before the first ``:`` or ``,`` of a bad result (``step returned int``)."""
    head = message.split(":", 1)[0].split(",", 1)[0].strip()
    return head[:80] or "error"


class EpisodeGeneration(Generation):
    """:class:`~geartrain.trainer.generation.Generation` whose rollout batches are
    episodes (:func:`generate_episodes`): training, validation, baselines and dynamic
    sampling all go through :meth:`generate`."""

    def generate(self, prompts: PromptBatch, sampling: SamplingParams) -> tuple[Batch, dict[str, float]]:
        return generate_episodes(self.actor, self.config, prompts, sampling)


def _final_text(record: dict[str, Any]) -> str:
    return next((t["text"] for t in reversed(record["turns"]) if t["role"] == "model"), "")


def render_sample(batch: Batch, row: int = 0) -> str:
    """One episode of ``batch`` as text: its task, then each model turn and observation on
    a line of its own, marked ``[model]`` / ``[obs]``, and how it ended."""
    record = batch["episode"][row]
    lines = [f"[task] {batch['prompt'][row]!r}  (ground truth {batch['ground_truth'][row]!r})"]
    for turn in record["turns"]:
        lines.append(f"[{'model' if turn['role'] == 'model' else 'obs'}] {turn['text']!r}")
    end = f"[end] {record['finish']}{' (truncated)' if record['truncated'] and record['finish'] != 'truncated' else ''}"
    lines.append(end + (f": {record['error']}" if record.get("error") else ""))
    return "\n".join(lines)


def log_sample(batch: Batch, output_dir: str | Path, step: int, rows: Sequence[int] = (0,)) -> str:
    """Append rendered episodes of ``batch`` (a validation's) to ``<output_dir>/episodes.log``
    under a header naming ``step``, the training steps done before it (0: before training),
    log them (``geartrain.agents``, INFO), and return the text."""
    text = (
        f"--- step {step}: validation episode(s) ---\n"
        + "\n\n".join(render_sample(batch, r) for r in rows if r < len(batch))
        + "\n"
    )
    path = Path(output_dir) / "episodes.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(text + "\n")
    logger.info("%s", text)
    return text
