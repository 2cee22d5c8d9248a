"""Rewards: rule-based scorers in a registry, user functions (callables or dotted
paths), per-sample or batched, one or several with weights, a batch scorer that survives
failing functions, and the reward-model hook.

Signature of a per-sample reward function::

    fn(response: str, ground_truth: str, *, prompt: str, meta: dict) -> float | dict

(a dict holds ``score`` and optional numeric extras such as ``acc``); of a batched one
(TRL's)::

    fn(prompts: list[str], completions: list[str], **columns) -> list[float | dict]

See :mod:`geartrain.rewards.terms`.
"""

from geartrain.rewards import rules
from geartrain.rewards.registry import REWARDS, RewardFn, RewardOutput, get_reward, register_reward
from geartrain.rewards.reward_model import sequence_scores_from_values
from geartrain.rewards.rules import gsm8k_answer, last_boxed, leading_integer, normalize_math
from geartrain.rewards.scoring import (
    RewardResult,
    RewardScorer,
    correctness,
    probe_term,
    score_batch,
    token_level_scores,
)
from geartrain.rewards.terms import RewardTerm, batched_reward, detect_batched, make_term

__all__ = [
    "REWARDS",
    "RewardFn",
    "RewardOutput",
    "RewardResult",
    "RewardScorer",
    "RewardTerm",
    "batched_reward",
    "correctness",
    "detect_batched",
    "get_reward",
    "gsm8k_answer",
    "last_boxed",
    "leading_integer",
    "make_term",
    "normalize_math",
    "probe_term",
    "register_reward",
    "rules",
    "score_batch",
    "sequence_scores_from_values",
    "token_level_scores",
]
