"""The workers behind each role. One worker lives on each rank of a worker group (see
:mod:`geartrain.cluster`); the trainer only calls their methods through the group.

* :class:`ActorRolloutWorker` — the hybrid engine: the actor's training engine and the
  rollout colocated on the same ranks, with the weight sync and the memory switch
  between training and generation.
* :class:`ReferenceWorker` — frozen reference policy: log-probs only.
* :class:`CriticWorker` — value model (PPO): values and its own update.
* :class:`RewardWorker` — rule functions on decoded text, or a reward model.
* :class:`SFTWorker` — supervised fine-tuning of the policy (the warm start).

Engines and rollouts are reached only through :class:`geartrain.Engine` /
:class:`geartrain.Rollout`, i.e. through the hooks.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from geartrain.agents import AgentConfig
from geartrain.algorithms import ActorLossConfig, CriticLossConfig, make_actor_loss, make_critic_loss
from geartrain.batch import Batch
from geartrain.checkpoint import CheckpointManager
from geartrain.config import EngineConfig, ModelConfig, RolloutConfig
from geartrain.engine import Engine
from geartrain.memory import current_memory_bytes
from geartrain.modeling import load_tokenizer
from geartrain.rewards import RewardScorer, sequence_scores_from_values
from geartrain.rewards.terms import TrainerState
from geartrain.rollout import Rollout
from geartrain.trainer.async_rollout import Generated, GenerationQueue, WeightSnapshot
from geartrain.trainer.episodes import run_episode_share
from geartrain.types import EngineContext, LossContext, LossFn, SamplingParams, StepOutput


def _sum_metrics(into: dict[str, float], new: dict[str, float]) -> None:
    for key, value in new.items():
        into[key] = into.get(key, 0.0) + float(value)


def plan_mini_batches(batch: Batch, epochs: int, mini_batches: int, seed: int) -> list[Batch]:
    """``epochs`` passes over ``batch`` in ``mini_batches`` shuffled mini-batches: one
    optimizer step each. Planned on the driver over the whole step's batch, so that every
    mini-batch is the same set of samples however many data-parallel ranks share it. A batch
    of fewer samples than ``mini_batches`` (dynamic sampling kept few) makes one mini-batch per
    sample: an empty one would step the optimizer on no gradient (Adam's moments still move
    the weights)."""
    parts: list[Batch] = []
    generator = torch.Generator().manual_seed(seed)
    pieces = max(1, min(mini_batches, len(batch)))
    for _ in range(epochs):
        order = torch.randperm(len(batch), generator=generator) if mini_batches > 1 else torch.arange(len(batch))
        parts += batch.index(order).split(pieces)
    return parts


def train_mini_batches(engine: Engine, parts: list[Batch], loss_fn: Any) -> dict[str, float]:
    """One ``forward_backward`` + optimizer step per mini-batch (this rank's share of it).
    Metrics are averaged over the optimizer steps."""
    totals: dict[str, float] = {}
    for part in parts:
        out = engine.forward_backward(part, loss_fn)
        _sum_metrics(totals, out.metrics)
        _sum_metrics(totals, engine.optimizer_step())
    return {k: v / max(len(parts), 1) for k, v in totals.items()}


def train_epochs(
    engine: Engine, batch: Batch | list[Batch], loss_fn: Any, epochs: int, mini_batches: int, seed: int
) -> dict[str, float]:
    """``batch`` as planned mini-batches (a list, see :func:`plan_mini_batches`), or a whole
    batch planned here into ``epochs`` x ``mini_batches`` optimizer steps."""
    parts = batch if isinstance(batch, list) else plan_mini_batches(batch, epochs, mini_batches, seed)
    return train_mini_batches(engine, parts, loss_fn)


def _prompts_and_sampling(
    prompts: list[list[int]] | Batch, sampling: SamplingParams
) -> tuple[list[list[int]], SamplingParams]:
    """A generate call's prompts: token-id lists, or a data-parallel share of a prompt batch
    (:func:`geartrain.cluster.dispatch.prompt_batch`) whose ``prompt_index`` keeps the
    samples placement-invariant."""
    if isinstance(prompts, Batch):
        return prompts["prompt_ids"], dataclasses.replace(sampling, prompt_indices=list(prompts["prompt_index"]))
    return prompts, sampling


def _global_prompt_index(batch: Batch, sampling: SamplingParams) -> Batch:
    """Rows' ``prompt_index`` in the whole call rather than in this rank's share."""
    if sampling.prompt_indices is not None and "prompt_index" in batch.meta:
        batch.meta["prompt_index"] = [sampling.prompt_indices[i] for i in batch.meta["prompt_index"]]
    return batch


def with_current_as_old(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` with each micro-batch's ``old_log_probs`` set to the detached log-probs
    of the same forward. When a batch gets exactly one optimizer step, that is what a
    separate old-log-prob forward would give (same weights, same micro-batches), without
    running it."""

    def wrapped(outputs: dict[str, torch.Tensor], mb: Batch, ctx: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
        mb["old_log_probs"] = outputs["log_probs"].detach()
        return loss_fn(outputs, mb, ctx)

    return wrapped


class ActorRolloutWorker:
    """The actor's engine and the rollout on the same rank (the hybrid engine)."""

    def __init__(
        self,
        engine: EngineConfig,
        model: ModelConfig,
        rollout: RolloutConfig,
        loss: ActorLossConfig,
        *,
        free_memory: bool,
        async_rollout: bool = False,
        ctx: EngineContext,
    ) -> None:
        self.engine = Engine(engine, model, ctx)
        self.rollout = Rollout(rollout, model, dataclasses.replace(ctx, role="rollout"))
        self.loss_fn = make_actor_loss(loss)
        self.rank = ctx.rank
        self.model_config = model
        self.tokenizer: Any = None
        self.free_memory = free_memory
        self.device = ctx.device
        self.rollout_released = False
        self.weights_stale = True
        self.version = 0
        """Policy updates so far; a batch's staleness is this minus its weights' version."""
        self.queue: GenerationQueue | None = None
        self.pending: deque[Future[Generated]] = deque()
        if async_rollout:
            if free_memory:
                raise ValueError("trainer.async_rollout generates while the actor trains: it cannot free_memory")
            self.queue = GenerationQueue(self.rollout)
            self._queue_weights()

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]] | Batch, sampling: SamplingParams) -> tuple[Batch, dict[str, float]]:
        """Train mode -> weight sync -> (free training memory) -> generate -> (free rollout
        memory) -> train mode. Returns the rollout batch and the switch's measurements.
        ``prompts`` may be this rank's data-parallel share of a prompt batch."""
        prompts, sampling = _prompts_and_sampling(prompts, sampling)
        metrics: dict[str, float] = {}
        if self.queue is not None:  # behind the queued work, with the newest queued weights
            submitted = time.perf_counter()
            done = self.queue.generate(prompts, sampling).result()
            metrics["timing/generate_s"] = done.seconds
            metrics["timing/rollout_wait_s"] = time.perf_counter() - submitted
            return done.batch, metrics
        self._enter_rollout(metrics)
        start = time.perf_counter()
        batch = _global_prompt_index(self.rollout.generate(prompts, sampling), sampling)
        batch.meta["rollout_rank"] = [self.rank] * len(batch)  # which replica sampled each row
        metrics["timing/generate_s"] = time.perf_counter() - start
        self._leave_rollout(metrics)
        return batch, metrics

    def run_episodes(
        self, prompts: Batch, sampling: SamplingParams, agent: AgentConfig, base_dir: str | None = None
    ) -> tuple[Batch, dict[str, float]]:
        """Multi-turn episodes (``rollout.agent``) for this rank's share of ``prompts`` (see
        :mod:`geartrain.trainer.episodes`), behind the same hybrid switch as :meth:`generate`,
        taken once for all turns."""
        if self.queue is not None:
            raise ValueError("rollout.agent episodes do not run with trainer.async_rollout")
        metrics: dict[str, float] = {}
        self._enter_rollout(metrics)
        start = time.perf_counter()
        batch, episode_metrics = run_episode_share(
            self.rollout.generate,
            self._tokenizer(),
            prompts,
            sampling,
            agent,
            base_dir=base_dir,
            max_model_len=self.rollout.config.max_model_len,
            rank=self.rank,
        )
        metrics.update(episode_metrics)
        metrics["timing/generate_s"] = time.perf_counter() - start
        self._leave_rollout(metrics)
        return batch, metrics

    def _tokenizer(self) -> Any:
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.model_config)
        return self.tokenizer

    def _enter_rollout(self, metrics: dict[str, float]) -> None:
        """Resume the rollout, sync stale weights, offload the actor (``free_memory``)."""
        if self.rollout_released:
            stats = self.rollout.resume()
            metrics["hybrid/rollout_resume_s"] = stats.seconds
            metrics["hybrid/rollout_resume_bytes"] = float(stats.after - stats.before)
            self.rollout_released = False
        if self.weights_stale:
            sync = self.engine.sync_weights(self.rollout)
            metrics["timing/weight_sync_s"] = sync.seconds
            metrics["hybrid/weight_sync_s"] = sync.seconds
            metrics["hybrid/weight_sync_bytes"] = float(sync.bytes)
            metrics["hybrid/weight_sync_buckets"] = float(sync.num_buckets)
            self.weights_stale = False
        if self.free_memory:
            stats = self.engine.offload()
            metrics["hybrid/actor_offload_s"] = stats.seconds
            metrics["hybrid/actor_offload_freed_bytes"] = float(stats.freed)

    def _leave_rollout(self, metrics: dict[str, float]) -> None:
        """Release the rollout and onload the actor (``free_memory``)."""
        if self.free_memory:
            stats = self.rollout.release()
            self.rollout_released = True
            metrics["hybrid/rollout_release_s"] = stats.seconds
            metrics["hybrid/rollout_release_freed_bytes"] = float(stats.freed)
            stats = self.engine.onload()
            metrics["hybrid/actor_onload_s"] = stats.seconds
        metrics["hybrid/memory_bytes"] = float(current_memory_bytes(self.device))

    def submit_generate(self, prompts: list[list[int]], sampling: SamplingParams) -> None:
        """Async rollout: queue a generation; it runs on the rollout's thread with the
        newest weights queued before it. :meth:`take_generated` returns the results in
        submission order."""
        assert self.queue is not None, "submit_generate needs trainer.async_rollout"
        self.pending.append(self.queue.generate(prompts, sampling))

    def take_generated(self) -> tuple[Batch, dict[str, float]]:
        """The oldest queued generation (waits for it), with ``staleness`` ``[B]``: the
        policy updates made since the weights that generated each sample."""
        start = time.perf_counter()
        done = self.pending.popleft().result()
        batch = done.batch
        batch["staleness"] = torch.full((len(batch),), float(self.version - done.version))
        return batch, {"timing/generate_s": done.seconds, "timing/rollout_wait_s": time.perf_counter() - start}

    def _queue_weights(self) -> float:
        """Async rollout: snapshot the current weights and queue their load into the
        rollout (after the generations already queued). Returns the snapshot's seconds."""
        assert self.queue is not None
        snapshot = WeightSnapshot(self.rollout.dtype, self.rollout.bucket_bytes)
        seconds = self.engine.sync_weights(snapshot).seconds
        self.queue.load(snapshot, self.version)
        return seconds

    def _updated(self) -> dict[str, float]:
        self.version += 1
        if self.queue is None:
            self.weights_stale = True
            return {}
        return {"timing/weight_snapshot_s": self._queue_weights()}

    # ------------------------------------------------------------------ training
    def compute_log_probs(self, batch: Batch, entropy: bool = True, sum_pi_squared: bool = False) -> StepOutput:
        """The old policy's per-token outputs (``sum_pi_squared``: also ``Σ_v π(v)²``)."""
        return self.engine.compute_log_probs(batch, entropy=entropy, sum_pi_squared=sum_pi_squared)

    def compute_ref_log_probs(self, batch: Batch) -> StepOutput:
        """The reference policy's log-probs when the actor trains LoRA adapters: its base
        model with the adapters off (no second copy of the weights)."""
        return self.engine.compute_log_probs(batch, adapters_off=True)

    def update(
        self, batch: Batch | list[Batch], epochs: int = 1, mini_batches: int = 1, seed: int = 0
    ) -> dict[str, float]:
        """Train on ``batch``: planned mini-batches (a list), or one batch planned here."""
        for part in batch if isinstance(batch, list) else [batch]:
            part.info["need_entropy"] = False
        metrics = train_epochs(self.engine, batch, self.loss_fn, epochs, mini_batches, seed)
        metrics.update(self._updated())
        return {f"actor/{k}" if "/" not in k else k: v for k, v in metrics.items()}

    def update_once(self, batch: Batch) -> StepOutput:
        """One optimizer step on the whole ``batch`` whose old log-probs are the update's
        own (see :func:`with_current_as_old`): returns the forward's per-token
        ``log_probs`` and ``entropy`` (detached) with the update's metrics."""
        batch.info["need_entropy"] = True
        out = self.engine.forward_backward(batch, with_current_as_old(self.loss_fn))
        metrics = dict(out.metrics)
        metrics.update(self.engine.optimizer_step())
        metrics.update(self._updated())
        return StepOutput(
            outputs=out.outputs, metrics={f"actor/{k}" if "/" not in k else k: v for k, v in metrics.items()}
        )

    # ------------------------------------------------------------------ state
    def save_checkpoint(self, root: str, step: int, extra: dict[str, Any], keep_last: int) -> str:
        return str(self.engine.save_checkpoint(CheckpointManager(root, keep_last), step, extra))

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        extra = self.engine.load_checkpoint(path)
        self.weights_stale = True
        if self.queue is not None:
            self._queue_weights()
        return extra

    def export_hf(self, path: str, tokenizer: Any) -> str:
        return str(self.engine.export_hf(path, tokenizer))

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close()
        self.rollout.shutdown()


class ReferenceWorker:
    """The frozen reference policy."""

    def __init__(self, engine: EngineConfig, model: ModelConfig, *, ctx: EngineContext) -> None:
        self.engine = Engine(engine, model, ctx)

    def compute_log_probs(self, batch: Batch) -> StepOutput:
        return self.engine.compute_log_probs(batch)


class CriticWorker:
    """The value model (PPO)."""

    def __init__(self, engine: EngineConfig, model: ModelConfig, loss: CriticLossConfig, *, ctx: EngineContext) -> None:
        self.engine = Engine(engine, model, ctx)
        self.loss_fn = make_critic_loss(loss)

    def compute_values(self, batch: Batch) -> StepOutput:
        return self.engine.compute_log_probs(batch)

    def update(
        self, batch: Batch | list[Batch], epochs: int = 1, mini_batches: int = 1, seed: int = 0
    ) -> dict[str, float]:
        metrics = train_epochs(self.engine, batch, self.loss_fn, epochs, mini_batches, seed)
        return {f"critic/{k}" if "/" not in k else k: v for k, v in metrics.items()}

    def save_checkpoint(self, root: str, step: int, extra: dict[str, Any], keep_last: int) -> str:
        return str(self.engine.save_checkpoint(CheckpointManager(root, keep_last), step, extra))

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return self.engine.load_checkpoint(path)


class RewardWorker:
    """Scores responses: a rule function on decoded text, or a reward model's value at
    the last response token."""

    def __init__(
        self,
        function: Any | None,
        engine: EngineConfig | None,
        model: ModelConfig | None,
        *,
        timeout_s: float | None = None,
        ctx: EngineContext,
    ) -> None:
        # resolved now, so a spec that cannot be resolved fails at start-up; one scorer for
        # the run, so a failing function's traceback is logged once
        self.function = RewardScorer(function, timeout_s=timeout_s) if function is not None else None
        self.engine = Engine(engine, model, ctx) if model is not None and engine is not None else None

    def score(self, batch: Batch) -> list[dict[str, Any]]:
        """One dict per sample (:meth:`RewardResult.rows`: its score, each term's score,
        extras such as ``acc``, error and timeout flags), so that the shares of several
        reward workers gather in the batch's order; the caller summarises them with
        :meth:`RewardResult.from_rows`."""
        if self.function is not None:
            state = batch.info.get("trainer_state")
            result = self.function.score(
                batch["response_text"],
                batch["ground_truth"],
                prompts=batch["prompt"],
                metas=batch["data_meta"],
                conversations=batch.get("prompt_messages"),
                trainer_state=TrainerState(**state) if state is not None else None,
                completion_ids=completion_ids(batch),
            )
            return result.rows()
        assert self.engine is not None
        values = self.engine.compute_log_probs(batch).outputs["values"]
        scores = sequence_scores_from_values(values, batch["response_mask"])
        return [{"score": s, "terms": {}, "extras": {}, "error": False, "timeout": False} for s in scores.tolist()]


def completion_ids(batch: Batch) -> list[list[int]] | None:
    """Each sample's token ids after its prompt (TRL's ``completion_ids``: a multi-turn
    episode's observations included, padding not); ``None`` for a batch of text only."""
    if "prompt_length" not in batch.info or "input_ids" not in batch or "attention_mask" not in batch:
        return None
    width = int(batch.info["prompt_length"])
    ids, mask = batch["input_ids"][:, width:], batch["attention_mask"][:, width:].bool()
    return [row[keep].tolist() for row, keep in zip(ids, mask, strict=True)]


def nll_loss(outputs: dict[str, torch.Tensor], batch: Batch, ctx: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean negative log-likelihood over ``loss_mask`` (global token count)."""
    mask = batch["loss_mask"].to(outputs["log_probs"])
    total = -(outputs["log_probs"] * mask).sum()
    share = total / max(ctx.global_tokens, 1)
    return share, {"sft/loss": float(share.detach())}


class SFTWorker:
    """Supervised fine-tuning of the policy model (the warm start), with an optional
    rollout to score it greedily while it trains."""

    def __init__(
        self, engine: EngineConfig, model: ModelConfig, rollout: RolloutConfig | None = None, *, ctx: EngineContext
    ) -> None:
        self.engine = Engine(engine, model, ctx)
        self.model_config = model
        self.rollout = None
        if rollout is not None:
            self.rollout = Rollout(rollout, model, dataclasses.replace(ctx, role="rollout"))

    def generate(self, prompts: list[list[int]] | Batch, sampling: SamplingParams) -> Batch:
        """Sample from the current SFT weights (synced into the rollout first)."""
        assert self.rollout is not None, "SFTWorker was built without a rollout"
        prompts, sampling = _prompts_and_sampling(prompts, sampling)
        self.engine.sync_weights(self.rollout)
        return _global_prompt_index(self.rollout.generate(prompts, sampling), sampling)

    def run_episodes(
        self, prompts: Batch, sampling: SamplingParams, agent: AgentConfig, base_dir: str | None = None
    ) -> Batch:
        """Multi-turn episodes from the current SFT weights (see
        :meth:`ActorRolloutWorker.run_episodes`)."""
        assert self.rollout is not None, "SFTWorker was built without a rollout"
        self.engine.sync_weights(self.rollout)
        batch, _ = run_episode_share(
            self.rollout.generate,
            load_tokenizer(self.model_config),
            prompts,
            sampling,
            agent,
            base_dir=base_dir,
            max_model_len=self.rollout.config.max_model_len,
            rank=self.engine.ctx.rank,
        )
        return batch

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.shutdown()

    def train_step(self, batch: Batch) -> dict[str, float]:
        out = self.engine.forward_backward(batch, nll_loss)
        metrics = dict(out.metrics)
        metrics.update(self.engine.optimizer_step())
        return metrics

    def sync_weights(self, receiver: Any) -> None:
        self.engine.sync_weights(receiver)

    def export_hf(self, path: str, tokenizer: Any) -> str:
        Path(path).mkdir(parents=True, exist_ok=True)
        return str(self.engine.export_hf(path, tokenizer))
