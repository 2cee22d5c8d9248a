"""The RL loop (GRPO and PPO), driving the roles through their worker groups.

One step: prompts -> rollout (``n`` samples each, behind the hybrid switch) -> reward ->
old / reference log-probs (and critic values) -> advantages -> critic and actor updates.
Validation (greedy, held-out prompts) runs every ``validation.every_n_steps`` steps and
checkpoints every ``trainer.save_every`` steps.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from geartrain.algorithms import (
    ActorLossConfig,
    AdvantageConfig,
    PolicyLossConfig,
    apply_kl_penalty,
    compute_advantages,
    get_advantage,
    kl_estimate,
    make_kl_controller,
    masked_mean,
    mismatch_metrics,
    truncated_is_weights,
)
from geartrain.algorithms.dapo import overlong_penalty
from geartrain.batch import Batch
from geartrain.cluster import Dispatch, WorkerGroup
from geartrain.cluster.dispatch import prompt_batch
from geartrain.data import PromptBatch, PromptLoader, PromptRow
from geartrain.rewards import token_level_scores
from geartrain.seeding import step_seed
from geartrain.trainer.config import TrainConfig
from geartrain.trainer.roles import plan_mini_batches
from geartrain.trainer.sampling import collect_informative
from geartrain.types import SamplingParams


def actor_loss_config(config: TrainConfig) -> ActorLossConfig:
    algo = config.algorithm
    return ActorLossConfig(
        policy_loss=algo.policy_loss,
        clip=PolicyLossConfig(
            clip_ratio=algo.clip_ratio,
            clip_ratio_low=algo.clip_ratio_low,
            clip_ratio_high=algo.clip_ratio_high,
            clip_ratio_c=algo.clip_ratio_c,
            tau_pos=algo.tau_pos,
            tau_neg=algo.tau_neg,
            clip_cov_ratio=algo.clip_cov_ratio,
            clip_cov_lb=algo.clip_cov_lb,
            clip_cov_ub=algo.clip_cov_ub,
            kl_cov_ratio=algo.kl_cov_ratio,
            kl_cov_coef=algo.kl_cov_coef,
        ),
        loss_agg_mode=algo.loss_agg_mode,
        entropy_coef=algo.entropy_coef,
        kl_loss_coef=algo.kl_loss_coef if algo.use_kl_loss else 0.0,
        kl_loss_kind=algo.kl_loss_kind,
        tis_cap=algo.tis_cap if algo.tis_cap is not None or not config.trainer.async_rollout else config.trainer.async_tis_cap,
        # seq-mean-token-sum-norm divides by the padded response length; batches are [B, T]
        # with the prompt in front, so the constant is the response budget, not T.
        norm_length=config.sampling.max_tokens,
    )




@dataclass
class RLRoles:
    actor: WorkerGroup
    reward: WorkerGroup
    reference: WorkerGroup | None = None
    critic: WorkerGroup | None = None


class RLTrainer:
    """GRPO / PPO over the roles in ``roles``."""

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
        self.val_rows = val_rows or []
        algo = config.algorithm
        self.kl_ctrl = (
            make_kl_controller(algo.kl_controller, algo.kl_coef, target_kl=algo.target_kl, horizon=algo.kl_horizon)
            if algo.use_kl_in_reward
            else None
        )
        self.stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.is_cap = actor_loss_config(config).tis_cap
        # async rollout: prompts of the steps generated ahead, with the loader's state
        # before each (a checkpoint must resume at the first step not trained yet)
        self.ahead: deque[tuple[PromptBatch, dict[str, Any]]] = deque()
        # ReMax-style estimators subtract the reward of a greedy response to each prompt
        self.needs_baselines = bool(getattr(get_advantage(algo.estimator), "needs_baselines", False))

    def loader_state(self) -> dict[str, Any]:
        """The data loader's position for a checkpoint: before the prompts of the first
        step not trained yet (async rollout draws prompts ahead of training)."""
        return self.ahead[0][1] if self.ahead else self.loader.state_dict()

    # ------------------------------------------------------------------ helpers
    def _sampling(self, step: int, round_: int = 0) -> SamplingParams:
        s = self.config.sampling
        return SamplingParams(
            n=s.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=s.max_tokens,
            stop_token_ids=self.stop_ids,
            # round 0 keeps the seed it always had; dynamic sampling's extra rounds differ
            seed=step_seed(self.config.trainer.seed, step, salt=100 + round_ if round_ else 0),
        )

    def reuses_update_log_probs(self) -> bool:
        """Whether a step skips the separate old-log-prob forward: the batch gets exactly
        one optimizer step (one epoch, one mini-batch), so the old log-probs are the
        detached log-probs of the update's own forward; nothing before the update needs
        them (no KL penalty in the reward); ``trainer.reuse_update_log_probs`` is on."""
        algo = self.config.algorithm
        return (
            self.config.trainer.reuse_update_log_probs
            and algo.ppo_epochs == 1
            and algo.mini_batches == 1
            and self.kl_ctrl is None
        )

    def _off_policy_record(self, batch: Batch) -> dict[str, Any]:
        """Per-sample staleness and mean truncated IS weight (the correction the loss
        applied, ``min(exp(old - rollout), cap)`` over the response), plus summaries."""
        mask = batch["response_mask"]
        staleness = batch["staleness"]
        record: dict[str, Any] = {
            "async/staleness_mean": float(staleness.mean()),
            "async/staleness_max": float(staleness.max()),
            "samples/staleness": [int(s) for s in staleness.tolist()],
        }
        if self.is_cap is not None and "old_log_probs" in batch:
            weights = truncated_is_weights(batch["old_log_probs"], batch["rollout_log_probs"], mask, cap=self.is_cap)
            per_sample = (weights * mask).sum(1) / mask.sum(1).clamp(min=1)
            record["async/is_weight_mean"] = float(masked_mean(weights, mask))
            record["async/is_weight_capped"] = float(masked_mean((weights >= self.is_cap).float(), mask))
            record["samples/is_weight"] = [round(w, 6) for w in per_sample.tolist()]
        return record

    @staticmethod
    def _ref_kl(batch: Batch) -> float:
        kl = kl_estimate(batch["old_log_probs"], batch["ref_log_probs"], "k3")
        return float(masked_mean(kl, batch["response_mask"]))

    def _decode(self, batch: Batch) -> list[str]:
        ids, mask = batch["input_ids"], batch["response_mask"].bool()
        return self.tokenizer.batch_decode([ids[i][mask[i]].tolist() for i in range(len(batch))], skip_special_tokens=True)

    def _rollout(self, prompts: PromptBatch, sampling: SamplingParams) -> tuple[Batch, dict[str, float]]:
        # each data-parallel rollout replica generates its share of the prompts
        batch, metrics = self.roles.actor.call("generate", prompt_batch(prompts.prompt_ids), sampling, dispatch=Dispatch.DP)
        return self._annotate(batch, prompts, sampling.n), metrics

    def _annotate(self, batch: Batch, prompts: PromptBatch, n: int) -> Batch:
        for key, values in prompts.sample_meta(n).items():
            batch[key] = values
        batch["response_text"] = self._decode(batch)
        return batch

    def _next_rollout(self, step: int) -> tuple[PromptBatch, Batch, dict[str, float]]:
        """Step ``step``'s samples. Async rollout: keep generations queued for steps
        ``step .. step + max_staleness`` and take this step's (generated while earlier
        steps trained)."""
        if not self.config.trainer.async_rollout:
            prompts = self.loader.next_batch()
            return prompts, *self._rollout(prompts, self._sampling(step))
        while len(self.ahead) <= self.config.trainer.max_staleness:
            state = self.loader.state_dict()
            prompts = self.loader.next_batch()
            self.roles.actor.call("submit_generate", prompts.prompt_ids, self._sampling(step + len(self.ahead)))
            self.ahead.append((prompts, state))
        prompts, _ = self.ahead.popleft()
        batch, metrics = self.roles.actor.call("take_generated")
        return prompts, self._annotate(batch, prompts, self.config.sampling.n), metrics

    def _score(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        scores, metrics, acc = self.roles.reward.call("score", batch, dispatch=Dispatch.DP)
        correct = torch.tensor([float(a) if a is not None else float(s > 0) for a, s in zip(acc, scores.tolist(), strict=True)])
        return scores, metrics, correct

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

    def _scored(self, batch: Batch, prompts: PromptBatch) -> tuple[Batch, dict[str, float]]:
        """Reward ``batch`` (the samples of ``prompts``): the sequence ``score`` (with DAPO's
        overlong penalty), ``correct`` and, for ReMax-style estimators, the greedy
        response's reward ``reward_baseline`` ride along as per-sample metadata."""
        scores, metrics, correct = self._shaped_scores(batch)
        batch["score"] = scores.tolist()
        batch["correct"] = correct.tolist()
        if self.needs_baselines:
            s = self.config.sampling
            greedy = SamplingParams(n=1, temperature=0.0, max_tokens=s.max_tokens, stop_token_ids=self.stop_ids, seed=0)
            g_batch, _ = self._rollout(prompts, greedy)
            g_scores, _, _ = self._shaped_scores(g_batch)
            batch["reward_baseline"] = [float(v) for v in g_scores.tolist() for _ in range(s.n)]
            metrics = {**metrics, "reward/greedy_baseline_mean": float(g_scores.mean())}
        return batch, metrics

    def _generate_scored(self, prompts: PromptBatch, sampling: SamplingParams) -> Batch:
        """One more round of dynamic sampling: generate and reward ``prompts``."""
        return self._scored(self._rollout(prompts, sampling)[0], prompts)[0]

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out prompts."""
        if not self.val_rows:
            return {}
        v = self.config.validation
        rows = self.val_rows[: v.max_prompts] if v.max_prompts else self.val_rows
        prompts = PromptBatch(rows=rows, indices=list(range(len(rows))), epoch=-1)
        sampling = SamplingParams(
            n=1, temperature=0.0, max_tokens=v.max_tokens or self.config.sampling.max_tokens, stop_token_ids=self.stop_ids, seed=0
        )
        start = time.perf_counter()
        batch, _ = self._rollout(prompts, sampling)
        scores, _, correct = self._score(batch)
        return {
            "val/accuracy": float(correct.mean()),
            "val/reward_mean": float(scores.mean()),
            "val/prompts": float(len(rows)),
            "timing/validation_s": time.perf_counter() - start,
        }

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> dict[str, float]:
        cfg, algo = self.config, self.config.algorithm
        t_step = time.perf_counter()
        metrics: dict[str, float] = {}

        prompts, batch, hybrid = self._next_rollout(step)
        metrics.update(hybrid)
        start = time.perf_counter()
        batch, reward_metrics = self._scored(batch, prompts)
        metrics["timing/reward_s"] = time.perf_counter() - start
        metrics.update(reward_metrics)
        first_scores, first_correct = torch.tensor(batch["score"]), torch.tensor(batch["correct"])
        metrics["reward/std"] = float(first_scores.std()) if len(first_scores) > 1 else 0.0
        metrics["reward/accuracy"] = float(first_correct.mean())
        if algo.dynamic_sampling:
            start = time.perf_counter()
            batch, ds_metrics = collect_informative(
                batch,
                lambda r: self._generate_scored(self.loader.next_batch(), self._sampling(step, r)),
                target_groups=len(prompts.rows),
                max_extra_rounds=algo.dynamic_sampling_max_extra_rounds,
            )
            metrics.update(ds_metrics)
            metrics["timing/dynamic_sampling_s"] = time.perf_counter() - start
        scores = torch.tensor(batch["score"], dtype=torch.float32)
        mask = batch["response_mask"]
        batch["loss_mask"] = mask

        actor_updates = step > algo.critic_warmup_steps or self.roles.critic is None
        reuse = actor_updates and self.reuses_update_log_probs()
        start = time.perf_counter()
        if not reuse:
            old = self.roles.actor.call("compute_log_probs", batch, dispatch=Dispatch.DP)
            batch["old_log_probs"] = old.outputs["log_probs"]
            if "routed_experts" in old.outputs:  # MoE router replay: the update routes as this forward did
                batch["routed_experts"] = old.outputs["routed_experts"]
            if "entropy" in old.outputs:
                metrics["actor/entropy"] = float(masked_mean(old.outputs["entropy"], mask))
            metrics.update(mismatch_metrics(batch["old_log_probs"], batch["rollout_log_probs"], mask))
        if self.roles.reference is not None:
            ref = self.roles.reference.call("compute_log_probs", batch, dispatch=Dispatch.DP)
            batch["ref_log_probs"] = ref.outputs["log_probs"]
            if not reuse:
                metrics["actor/ref_kl"] = self._ref_kl(batch)
        if self.roles.critic is not None:
            values = self.roles.critic.call("compute_values", batch, dispatch=Dispatch.DP)
            batch["old_values"] = values.outputs["values"]
        metrics["timing/log_probs_s"] = time.perf_counter() - start

        token_rewards = token_level_scores(scores, mask)
        if self.kl_ctrl is not None:
            token_rewards, kl_metrics = apply_kl_penalty(
                token_rewards, batch["old_log_probs"], batch["ref_log_probs"], mask, coef=self.kl_ctrl.value, kind=algo.kl_kind
            )
            metrics.update(kl_metrics)
            self.kl_ctrl.update(kl_metrics["actor/reward_kl_penalty"], n_steps=len(batch))
        advantages, returns = compute_advantages(
            algo.estimator,
            token_rewards,
            mask,
            config=AdvantageConfig(
                gamma=algo.gamma, lam=algo.lam, norm_by_std=algo.norm_by_std, unbiased_var=algo.unbiased_var
            ),
            group_ids=batch["uid"],
            values=batch.get("old_values"),
            baselines=torch.tensor(batch["reward_baseline"]) if self.needs_baselines else None,
        )
        batch["advantages"] = advantages
        batch["returns"] = returns
        metrics["advantages/abs_mean"] = float(masked_mean(advantages.abs(), mask))  # 0: no learning signal (watchdog)

        start = time.perf_counter()
        seed = step_seed(cfg.trainer.seed, step, salt=1)
        # mini-batches are planned here, over the whole batch: each is then split across ranks
        plan = plan_mini_batches(batch, algo.ppo_epochs, algo.mini_batches, seed)
        if self.roles.critic is not None:
            metrics.update(self.roles.critic.call("update", plan, dispatch=Dispatch.DP))
        if reuse:
            # one optimizer step: its own forward gives the old log-probs (and the metrics
            # the separate forward would have given)
            out = self.roles.actor.call("update_once", batch, dispatch=Dispatch.DP)
            metrics.update(out.metrics)
            batch["old_log_probs"] = out.outputs["log_probs"]
            metrics["actor/entropy"] = float(masked_mean(out.outputs["entropy"], mask))
            metrics.update(mismatch_metrics(batch["old_log_probs"], batch["rollout_log_probs"], mask))
            if self.roles.reference is not None:
                metrics["actor/ref_kl"] = self._ref_kl(batch)
        elif actor_updates:
            metrics.update(self.roles.actor.call("update", plan, dispatch=Dispatch.DP))
        metrics["timing/update_s"] = time.perf_counter() - start
        if "staleness" in batch:
            metrics.update(self._off_policy_record(batch))

        lengths = mask.sum(-1).float()
        metrics["response/length_mean"] = float(lengths.mean())
        metrics["response/length_max"] = float(lengths.max())
        metrics["response/clip_ratio"] = sum(r == "length" for r in batch["finish_reason"]) / len(batch)
        metrics["timing/step_s"] = time.perf_counter() - t_step
        tokens = float(batch["attention_mask"].sum())
        metrics["perf/tokens"] = tokens
        metrics["perf/tokens_per_s"] = tokens / max(metrics["timing/step_s"], 1e-9)
        metrics["perf/generated_tokens_per_s"] = float(mask.sum()) / max(metrics["timing/generate_s"], 1e-9)
        return metrics
