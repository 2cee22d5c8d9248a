"""Supervised fine-tuning (the warm start before RL).

Rows hold a ``prompt`` and a ``response`` (the key is ``sft.response_key``); each training
sequence is the prompt's tokens then the response's tokens and EOS, laid out like a
rollout batch (left-padded prompt, right-padded response), with the loss on the response.

Multi-turn traces (the warm start of an agent) hold ``turns`` instead of a response:
``[{"role": "model", "text": ...}, {"role": "observation", "text": ...}, ...]``. Each turn
is tokenized on its own (as the episode runner tokenizes observations: once, never with
the history) and the loss is on the model turns and the final EOS only: observation tokens
are masked, as in RL. Where the episodes render observations with the chat template
(``rollout.agent.chat_template``), so do the traces (:func:`observation_renderer`): the
warm start teaches the format the RL episodes show.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from geartrain.agents import AgentConfig
from geartrain.agents.formats import chat_bridge
from geartrain.batch import Batch
from geartrain.cluster import Dispatch, WorkerGroup
from geartrain.data import DataConfig, PromptDataset, PromptLoader, PromptRow
from geartrain.errors import DataError
from geartrain.layout import sequence_batch
from geartrain.trainer.config import SFTConfig


def sft_dataset(
    config: SFTConfig,
    path: str,
    tokenizer: Any,
    data: DataConfig,
    *,
    tools: Sequence[Mapping[str, Any]] = (),
    environment_tools: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    environment_key: str = "environment",
    prompt_optional: bool = False,
) -> PromptDataset:
    """The SFT rows (prompt handling as in the RL data section, the tools included as
    :class:`PromptDataset` takes them; the response is required)."""
    cfg = data.model_copy(
        update={"path": path, "require_ground_truth": False, "batch_size": config.batch_size, "seed": config.seed}
    )
    rows: list[dict[str, Any]] | str = path
    if config.max_prompts is not None:
        from geartrain.data.sources import read_rows

        rows = [row for _, row in read_rows(path)][: config.max_prompts]
    dataset = PromptDataset(
        rows,
        tokenizer,
        cfg,
        tools=tools,
        environment_tools=environment_tools,
        environment_key=environment_key,
        prompt_optional=prompt_optional,
    )
    for row in dataset.rows:
        turns = row.meta.get("turns")
        if turns is not None:
            if not isinstance(turns, list) or not all(
                isinstance(t, dict) and t.get("role") in ("model", "observation") and isinstance(t.get("text"), str)
                for t in turns
            ):
                raise DataError(
                    f'{row.where or path}: \'turns\' must be a list of {{"role": "model" | "observation", "text": str}}'
                )
            if not turns:
                raise DataError(f"{row.where or path}: 'turns' is empty: a trace needs at least one model turn")
            if turns[-1]["role"] == "observation":
                raise DataError(
                    f"{row.where or path}: 'turns' ends on an observation (turn {len(turns)}): a trace ends on a "
                    "model turn, its answer, as an episode does (the environment's last observation is not appended)"
                )
        elif not isinstance(row.meta.get(config.response_key), str):
            raise DataError(
                f"{row.where or path}: SFT rows need a string '{config.response_key}' (or multi-turn 'turns')"
            )
    return dataset


def observation_renderer(agent: AgentConfig | None, tokenizer: Any) -> Callable[[str], str] | None:
    """How a trace's observation turn becomes text, as the episode runner renders an
    observation: the chat template's bridge with one ``observation_role`` message when
    ``agent.chat_template`` is set; ``None`` (the text as is) otherwise."""
    if agent is None or not agent.chat_template:
        return None
    role = agent.observation_role
    return lambda text: chat_bridge(tokenizer, [text], role)


def sft_batch(
    rows: list[PromptRow],
    tokenizer: Any,
    response_key: str,
    *,
    render_observation: Callable[[str], str] | None = None,
) -> Batch:
    """Token ids, attention mask and loss mask (response + EOS) for ``rows``, in the rollout
    layout (:func:`geartrain.layout.sequence_batch`); a trace's observation turns go through
    ``render_observation`` first (see :func:`observation_renderer`)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or 0
    tail = [eos] if eos is not None else []
    responses: list[list[int]] = []
    masks: list[list[int]] = []
    for r in rows:
        if "turns" in r.meta:
            ids, mask = [], []
            for turn in r.meta["turns"]:
                text = turn["text"]
                if turn["role"] == "observation" and render_observation is not None:
                    text = render_observation(text)
                turn_ids = tokenizer.encode(text, add_special_tokens=False)
                ids += turn_ids
                mask += [int(turn["role"] == "model")] * len(turn_ids)
        else:
            ids = list(tokenizer.encode(r.meta[response_key], add_special_tokens=False))
            mask = [1] * len(ids)
        responses.append(ids + tail)
        masks.append(mask + [1] * len(tail))
    batch = sequence_batch([r.prompt_ids for r in rows], responses, pad, mask_key="loss_mask")
    width = int(batch.info["prompt_length"])
    for row, mask in enumerate(masks):
        batch["loss_mask"][row, width : width + len(mask)] = torch.tensor(mask, dtype=batch["loss_mask"].dtype)
    return batch


def run_sft(
    worker: WorkerGroup,
    dataset: PromptDataset,
    config: SFTConfig,
    tokenizer: Any,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    evaluate: Callable[[], float] | None = None,
    *,
    render_observation: Callable[[str], str] | None = None,
) -> tuple[int, dict[str, float]]:
    """Up to ``config.steps`` optimizer steps of ``config.batch_size`` rows each.

    Every ``config.eval_every`` steps ``evaluate()`` (the dev accuracy) is recorded as
    ``sft/dev_accuracy``; once it reaches ``config.stop_at_accuracy`` (and ``min_steps``
    are done) the warm start stops. ``on_step`` gets every step's metrics. Returns the
    number of steps run and the last step's metrics."""
    loader = PromptLoader(dataset, config.batch_size, shuffle=True, seed=config.seed, drop_last=False)
    metrics: dict[str, float] = {}
    step = 0
    for step in range(1, config.steps + 1):
        start = time.perf_counter()
        batch = sft_batch(
            loader.next_batch().rows, tokenizer, config.response_key, render_observation=render_observation
        )
        metrics = worker.call("train_step", batch, dispatch=Dispatch.DP)
        metrics["timing/step_s"] = time.perf_counter() - start
        stop = False
        if evaluate is not None and step % config.eval_every == 0:
            metrics["sft/dev_accuracy"] = accuracy = evaluate()
            stop = (
                config.stop_at_accuracy is not None and step >= config.min_steps and accuracy >= config.stop_at_accuracy
            )
        if on_step is not None:
            on_step(step, metrics)
        if stop:
            break
    return step, metrics
