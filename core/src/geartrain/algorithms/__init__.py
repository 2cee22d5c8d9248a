"""RL algorithms as pure tensor functions: advantage estimators, policy/value losses,
loss aggregation, KL to the reference, and rollout-mismatch correction.

DAPO's batch-level pieces (overlong reward shaping, dynamic sampling's group filter) are in
:mod:`geartrain.algorithms.dapo`.

Tensors are ``[B, T]`` aligned to ``input_ids`` with masks (see :mod:`geartrain.types`);
every function works on any ``[B, L]`` with a mask. Numerical conventions follow verl 0.9
(docs: ALGORITHMS.md). Estimators and policy losses live in registries users extend with
:func:`register_advantage` / :func:`register_policy_loss`.
"""

from geartrain.algorithms.advantages import (
    ADVANTAGES,
    AdvantageConfig,
    AdvantageEstimator,
    compute_advantages,
    get_advantage,
    group_stats,
    register_advantage,
    sequence_scores,
)
from geartrain.algorithms.aggregation import AGG_MODES, AggMode, aggregate
from geartrain.algorithms.correction import masked_is_weights, mismatch_metrics, truncated_is_weights
from geartrain.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    kl_estimate,
    make_kl_controller,
)
from geartrain.algorithms.losses import (
    ActorLossConfig,
    CriticLossConfig,
    entropy_bonus,
    make_actor_loss,
    make_critic_loss,
    value_loss,
)
from geartrain.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from geartrain.algorithms.otb import optimal_token_baseline, tir_optimal_token_baseline
from geartrain.algorithms.policy_losses import (
    POLICY_LOSSES,
    PolicyLoss,
    PolicyLossConfig,
    PolicyLossOutput,
    cispo_loss,
    clip_cov_loss,
    dppo_kl_loss,
    dppo_tv_loss,
    dro_loss,
    get_policy_loss,
    gmpo_loss,
    gpg_loss,
    gspo_loss,
    kl_cov_loss,
    ppo_clip_loss,
    register_policy_loss,
    reinforce_loss,
    sapo_loss,
)
from geartrain.algorithms.registry import Registry

__all__ = [
    "ActorLossConfig",
    "CriticLossConfig",
    "make_actor_loss",
    "make_critic_loss",
    "ADVANTAGES",
    "AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageConfig",
    "AdvantageEstimator",
    "AggMode",
    "FixedKLController",
    "KLController",
    "PolicyLoss",
    "PolicyLossConfig",
    "PolicyLossOutput",
    "Registry",
    "aggregate",
    "cispo_loss",
    "clip_cov_loss",
    "dppo_kl_loss",
    "dppo_tv_loss",
    "dro_loss",
    "gmpo_loss",
    "gpg_loss",
    "kl_cov_loss",
    "reinforce_loss",
    "sapo_loss",
    "apply_kl_penalty",
    "compute_advantages",
    "entropy_bonus",
    "get_advantage",
    "get_policy_loss",
    "group_stats",
    "gspo_loss",
    "kl_estimate",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mismatch_metrics",
    "optimal_token_baseline",
    "ppo_clip_loss",
    "register_advantage",
    "register_policy_loss",
    "sequence_scores",
    "tir_optimal_token_baseline",
    "truncated_is_weights",
    "masked_is_weights",
    "value_loss",
]
