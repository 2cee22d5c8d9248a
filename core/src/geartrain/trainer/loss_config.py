"""The loss settings of the trained roles, read from a :class:`TrainConfig`."""

from __future__ import annotations

from geartrain.algorithms import ActorLossConfig, CriticLossConfig, PolicyLossConfig
from geartrain.trainer.config import TrainConfig


def actor_loss_config(config: TrainConfig) -> ActorLossConfig:
    """The actor's loss: ``algorithm.*`` (policy loss, clipping, aggregation, entropy and
    KL terms) and the truncated IS cap (``algorithm.tis_cap``, or when samples may be
    off-policy (:func:`off_policy`) ``trainer.async_tis_cap``)."""
    algo, trainer = config.algorithm, config.trainer
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
            dro_beta=algo.dro_beta,
        ),
        loss_agg_mode=algo.loss_agg_mode,
        entropy_coef=algo.entropy_coef,
        kl_loss_coef=algo.kl_loss_coef if algo.use_kl_loss else 0.0,
        kl_loss_kind=algo.kl_loss_kind,
        tis_cap=algo.tis_cap if algo.tis_cap is not None or not off_policy(config) else trainer.async_tis_cap,
        is_correction=algo.off_policy_correction,
        is_mask_low=algo.is_mask_low,
        # seq-mean-token-sum-norm divides by the padded response length; batches are [B, T]
        # with the prompt in front, so the constant is the response budget, not T.
        norm_length=response_budget(config),
    )


def off_policy(config: TrainConfig) -> bool:
    """Whether samples may come from weights older than the policy trained on them: the
    async rollout, or the separate rollout with ``algorithm.max_staleness > 0``."""
    separate = config.rollout.placement == "separate" and config.algorithm.max_staleness > 0
    return config.trainer.async_rollout or separate


def critic_loss_config(config: TrainConfig) -> CriticLossConfig:
    """The critic's value loss: clipped at ``algorithm.value_clip``."""
    return CriticLossConfig(clip_range=config.algorithm.value_clip, norm_length=response_budget(config))


def response_budget(config: TrainConfig) -> int:
    """The longest response region a row can have: ``sampling.max_tokens``, or for
    multi-turn episodes (``rollout.agent``) the episode's token budget (model and
    observation tokens after the task prompt)."""
    agent = config.rollout.agent
    if agent is None:
        return config.sampling.max_tokens
    return agent.max_episode_tokens or config.rollout.max_model_len
