"""The RL loop (GRPO and PPO), driving the roles through their worker groups.

One step (:meth:`RLTrainer.step`), in pipeline order: prompts -> rollout (``n`` samples
each, behind the hybrid switch; :mod:`geartrain.trainer.generation`) -> reward (with DAPO's
overlong shaping and ReMax's greedy baseline) -> dynamic sampling
(:mod:`geartrain.trainer.sampling`) -> old / reference log-probs and critic values
(:mod:`geartrain.trainer.log_probs`) -> advantages (with the KL penalty in the reward) ->
critic and actor updates -> the batch's metrics (:mod:`geartrain.trainer.step_metrics`).
Validation (greedy, held-out prompts) runs every ``validation.every_n_steps`` steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from geartrain.algorithms import (
    AdvantageConfig,
    apply_kl_penalty,
    compute_advantages,
    get_advantage,
    make_kl_controller,
    masked_is_weights,
    masked_mean,
    truncated_is_weights,
)
from geartrain.algorithms.dapo import overlong_penalty
from geartrain.batch import Batch
from geartrain.cluster import Dispatch, WorkerGroup
from geartrain.data import PromptBatch, PromptLoader, PromptRow
from geartrain.errors import GeartrainError
from geartrain.rewards import RewardResult, token_level_scores
from geartrain.seeding import step_seed
from geartrain.trainer.accuracy import accuracy_of
from geartrain.trainer.config import TrainConfig
from geartrain.trainer.episodes import EpisodeGeneration, log_sample
from geartrain.trainer.generation import Generation
from geartrain.trainer.log_probs import forward, needs_sum_pi_squared, reuses_update_log_probs, update_reusing
from geartrain.trainer.loss_config import actor_loss_config
from geartrain.trainer.roles import plan_mini_batches
from geartrain.trainer.sampling import collect_informative
from geartrain.trainer.step_metrics import off_policy_metrics, response_metrics, reward_metrics, timed


def reward_components(batch: Batch, keys: list[str] | None) -> torch.Tensor:
    """``[B, K]``: each sample's score from the reward terms ``keys`` (``None``: every term,
    in the reward's order), read from the batch's ``reward_terms``."""
    terms = batch["reward_terms"]
    known = list(terms[0]) if terms else []
    keys = keys or known
    missing = sorted({k for k in keys for row in terms if row.get(k) is None})
    if missing:
        raise GeartrainError(
            f"algorithm.gdpo_reward_keys: no score from reward term(s) {missing} for some samples "
            f"(the reward's functions: {known}); name [[reward.functions]] entries"
        )
    return torch.tensor([[float(row[k]) for k in keys] for row in terms], dtype=torch.float32)


@dataclass
class RLRoles:
    actor: WorkerGroup
    reward: WorkerGroup
    reference: WorkerGroup | None = None
    reference_call: str = "compute_log_probs"
    """The reference group's method for reference log-probs (``compute_ref_log_probs`` when
    the reference is the LoRA actor's base: ``reference`` is then the actor's group)."""
    critic: WorkerGroup | None = None
    rollout: WorkerGroup | None = None
    """``rollout.placement = "separate"``: the replicas' group (then ``actor`` holds no
    rollout and :class:`~geartrain.trainer.separate.SeparateGeneration` generates)."""


class RLTrainer:
    """GRPO / PPO over the roles in ``roles``. ``generation`` turns prompt batches into
    rollout batches (replace it for another kind of rollout)."""

    def __init__(
        self,
        config: TrainConfig,
        roles: RLRoles,
        tokenizer: Any,
        loader: PromptLoader,
        val_rows: list[PromptRow] | None = None,
    ) -> None:
        self.config = config
        self.roles = roles
        self.tokenizer = tokenizer
        self.loader = loader
        self.accuracy = accuracy_of(config)
        self.val_rows = val_rows or []
        # multi-turn episodes (rollout.agent) or one response per prompt
        generation = EpisodeGeneration if config.rollout.agent is not None else Generation
        self.generation = generation(config, roles.actor, tokenizer, loader)
        if roles.rollout is not None:  # rollout.placement = "separate": the replicas generate
            from geartrain.trainer.separate import SeparateGeneration, VersionedGroup

            assert isinstance(roles.actor, VersionedGroup), "the separate rollout needs the actor's VersionedGroup"
            self.generation = SeparateGeneration(config, roles.actor, roles.rollout, tokenizer, loader)
        self.validations = 0
        self.trainer_state: dict[str, Any] = {
            "global_step": 0,
            "max_steps": config.trainer.total_steps,
            "epoch": 0.0,
        }
        """TRL's ``trainer_state`` for reward functions: the step being scored (validation:
        the last one)."""
        algo = config.algorithm
        self.kl_ctrl = (
            make_kl_controller(algo.kl_controller, algo.kl_coef, target_kl=algo.target_kl, horizon=algo.kl_horizon)
            if algo.use_kl_in_reward
            else None
        )
        self.is_cap = actor_loss_config(config).tis_cap
        # ReMax-style estimators subtract the reward of a greedy response to each prompt
        self.needs_baselines = bool(getattr(get_advantage(algo.estimator), "needs_baselines", False))
        # GDPO-style estimators normalise each reward term on its own
        self.needs_components = bool(getattr(get_advantage(algo.estimator), "needs_reward_components", False))
        # the optimal token baseline reads the old policy's Σπ² (and old log-probs) per token
        self.needs_sum_pi_squared = needs_sum_pi_squared(config)

    def loader_state(self) -> dict[str, Any]:
        """The data loader's position for a checkpoint (see :meth:`Generation.loader_state`)."""
        return self.generation.loader_state()

    # ------------------------------------------------------------------ reward
    def _score(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        """The reward role's ``(scores, metrics, correct)``; ``correct`` is what
        ``reward.accuracy`` declares (:mod:`geartrain.trainer.accuracy`)."""
        batch.info["trainer_state"] = dict(self.trainer_state)  # TRL's, for reward functions
        result = RewardResult.from_rows(self.roles.reward.call("score", batch, dispatch=Dispatch.DP))
        correct = self.accuracy(result, batch)
        metrics = dict(result.metrics)
        metrics.pop("reward/acc", None)  # the step's reward/accuracy is this (or score > 0 where acc is absent)
        rows = result.rows()
        batch["reward_terms"] = [dict(row["terms"]) for row in rows]
        if result.columns:  # TRL's log_extra: columns of completions.jsonl
            batch["reward_columns"] = [dict(row["columns"]) for row in rows]
        return result.scores, metrics, torch.tensor(correct)

    def _shaped_scores(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        """Scores with DAPO's overlong penalty added when ``algorithm.overlong_buffer`` is set."""
        scores, metrics, correct = self._score(batch)
        algo = self.config.algorithm
        if algo.overlong_buffer is not None:
            penalty = overlong_penalty(
                batch["response_mask"].sum(-1),
                max_length=self.config.sampling.max_tokens,
                buffer=algo.overlong_buffer,
                factor=algo.overlong_penalty_factor,
            )
            scores = scores + penalty.to(scores)
            metrics = {**metrics, "reward/overlong_penalty_mean": float(penalty.mean())}
        return scores, metrics, correct

    def reward(self, batch: Batch, prompts: PromptBatch) -> dict[str, float]:
        """Reward ``batch`` (the samples of ``prompts``): the sequence ``score`` (with DAPO's
        overlong penalty), ``correct`` and, for ReMax-style estimators, the greedy
        response's reward ``reward_baseline`` ride along as per-sample metadata."""
        scores, metrics, correct = self._shaped_scores(batch)
        batch["score"] = scores.tolist()
        batch["correct"] = correct.tolist()
        if self.needs_baselines:
            g_batch, _ = self.generation.generate(prompts, self.generation.greedy())
            g_scores, _, _ = self._shaped_scores(g_batch)
            batch["reward_baseline"] = [float(v) for v in g_scores.tolist() for _ in range(self.config.sampling.n)]
            metrics = {**metrics, "reward/greedy_baseline_mean": float(g_scores.mean())}
        return metrics

    def _keep_informative(self, batch: Batch, step: int, groups: int) -> tuple[Batch, dict[str, float]]:
        """DAPO's dynamic sampling: rewarded extra rounds until ``groups`` informative groups."""

        def generate_more(round_: int) -> Batch:
            prompts = self.loader.next_batch()
            more, _ = self.generation.generate(prompts, self.generation.sampling(step, round_))
            self.reward(more, prompts)
            return more

        rounds = self.config.algorithm.dynamic_sampling_max_extra_rounds
        return collect_informative(batch, generate_more, target_groups=groups, max_extra_rounds=rounds)

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out prompts."""
        if not self.val_rows:
            return {}
        v = self.config.validation
        rows = self.val_rows[: v.max_prompts] if v.max_prompts else self.val_rows
        prompts = PromptBatch(rows=rows, indices=list(range(len(rows))), epoch=-1)
        start = time.perf_counter()
        batch, _ = self.generation.generate(prompts, self.generation.greedy(v.max_tokens))
        scores, _, correct = self._score(batch)
        self.validations += 1
        if "episode" in batch:  # one rendered episode per validation, in <output_dir>/episodes.log
            log_sample(batch, self.config.trainer.output_dir, int(self.trainer_state["global_step"]))
        batch["score"] = scores.tolist()
        self.last_validation: Batch | None = batch  # its greedy outputs, for completions.jsonl
        return {
            "val/accuracy": float(correct.mean()),
            "val/reward_mean": float(scores.mean()),
            "val/prompts": float(len(rows)),
            "timing/validation_s": time.perf_counter() - start,
        }

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> dict[str, float]:
        """One RL step, stage after stage; returns its metrics."""
        started = time.perf_counter()
        algo = self.config.algorithm
        prompts, batch, metrics = self.generation.next(step)
        self.trainer_state = {
            "global_step": step,
            "max_steps": self.config.trainer.total_steps,
            "epoch": float(max(prompts.epoch, 0)),
        }
        with timed(metrics, "timing/reward_s"):
            metrics.update(self.reward(batch, prompts))
        metrics.update(reward_metrics(batch))
        if algo.dynamic_sampling:
            with timed(metrics, "timing/dynamic_sampling_s"):
                batch, ds_metrics = self._keep_informative(batch, step, len(prompts.rows))
                metrics.update(ds_metrics)
        batch["loss_mask"] = batch["response_mask"]

        actor_updates = step > algo.critic_warmup_steps or self.roles.critic is None
        reuse = actor_updates and reuses_update_log_probs(self.config)
        with timed(metrics, "timing/log_probs_s"):
            old_from = None if reuse else self.roles.actor  # reuse: the update gives the old log-probs
            metrics.update(
                forward(
                    batch,
                    actor=old_from,
                    reference=self.roles.reference,
                    critic=self.roles.critic,
                    reference_call=self.roles.reference_call,
                    sum_pi_squared=self.needs_sum_pi_squared,
                )
            )
        metrics.update(self.advantages(batch))
        with timed(metrics, "timing/update_s"):
            metrics.update(self.update(batch, step, actor=actor_updates, reuse=reuse))
        if "staleness" in batch:
            metrics.update(off_policy_metrics(batch, self.is_cap))
        step_s = time.perf_counter() - started
        metrics.update(response_metrics(batch, step_s=step_s, generate_s=metrics["timing/generate_s"]))
        self.last_batch: Batch | None = batch  # the step's samples, for completions.jsonl
        return metrics

    def advantages(self, batch: Batch) -> dict[str, float]:
        """Token rewards (the sequence score on the last response token, minus the KL
        penalty when it is in the reward) -> ``advantages`` and ``returns`` on ``batch``."""
        algo, mask = self.config.algorithm, batch["response_mask"]
        metrics: dict[str, float] = {}
        token_rewards = token_level_scores(torch.tensor(batch["score"], dtype=torch.float32), mask)
        if "turn_rewards" in batch:  # episodes: each turn's environment reward on its last token
            token_rewards = token_rewards + batch["turn_rewards"]
        if self.kl_ctrl is not None:
            token_rewards, kl_metrics = apply_kl_penalty(
                token_rewards,
                batch["old_log_probs"],
                batch["ref_log_probs"],
                mask,
                coef=self.kl_ctrl.value,
                kind=algo.kl_kind,
            )
            metrics.update(kl_metrics)
            self.kl_ctrl.update(kl_metrics["actor/reward_kl_penalty"], n_steps=len(batch))
        batch["advantages"], batch["returns"] = compute_advantages(
            algo.estimator,
            token_rewards,
            mask,
            config=AdvantageConfig(
                gamma=algo.gamma,
                lam=algo.lam,
                norm_by_std=algo.norm_by_std,
                unbiased_var=algo.unbiased_var,
                gpg_f_norm=algo.gpg_f_norm,
                otb_handle_zero_tail=algo.otb_handle_zero_tail,
                gdpo_weights=tuple(algo.gdpo_reward_weights) if algo.gdpo_reward_weights else None,
            ),
            group_ids=batch["uid"],
            values=batch.get("old_values"),
            baselines=torch.tensor(batch["reward_baseline"]) if self.needs_baselines else None,
            components=reward_components(batch, algo.gdpo_reward_keys) if self.needs_components else None,
            **(self._policy_inputs(batch) if self.needs_sum_pi_squared else {}),
        )
        # 0: no learning signal (the watchdog stops the run)
        metrics["advantages/abs_mean"] = float(masked_mean(batch["advantages"].abs(), mask))
        return metrics

    def _policy_inputs(self, batch: Batch) -> dict[str, torch.Tensor | None]:
        """What the optimal token baseline reads: the old policy's log-probs and ``Σπ²``,
        and the rollout importance weights the actor's loss applies (verl's
        ``rollout_is_weights``: with ``tis_cap``, truncated or masked as the loss does)."""
        loss = actor_loss_config(self.config)
        weights = None
        if loss.tis_cap is not None:
            old, rollout, mask = batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"]
            if loss.is_correction == "mask":
                weights = masked_is_weights(old, rollout, mask, low=loss.is_mask_low, high=loss.tis_cap)
            else:
                weights = truncated_is_weights(old, rollout, mask, cap=loss.tis_cap)
        return {
            "old_log_probs": batch["old_log_probs"],
            "sum_pi_squared": batch["sum_pi_squared"],
            "is_weights": weights,
        }

    def update(self, batch: Batch, step: int, *, actor: bool, reuse: bool) -> dict[str, Any]:
        """The critic's update, then the actor's (when ``actor``; ``reuse``: one optimizer
        step whose forward gives the old log-probs, see :mod:`geartrain.trainer.log_probs`)."""
        algo = self.config.algorithm
        # mini-batches are planned here, over the whole batch: each is then split across ranks
        seed = step_seed(self.config.trainer.seed, step, salt=1)
        plan = plan_mini_batches(batch, algo.ppo_epochs, algo.mini_batches, seed)
        metrics: dict[str, Any] = {}
        if self.roles.critic is not None:
            metrics.update(self.roles.critic.call("update", plan, dispatch=Dispatch.DP))
        # the next step's generation goes right behind the actor's update (see Generation.prefetch)
        prefetch = step < self.config.trainer.total_steps and self.generation.can_prefetch()
        then = (lambda: self.generation.prefetch(step + 1)) if prefetch else None
        if reuse:
            metrics.update(update_reusing(self.roles.actor, batch, then=then))
        elif actor and then is not None:
            pending = self.roles.actor.submit("update", plan, dispatch=Dispatch.DP)
            then()
            metrics.update(pending.result())
        elif actor:
            metrics.update(self.roles.actor.call("update", plan, dispatch=Dispatch.DP))
        return metrics
