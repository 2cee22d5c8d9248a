"""Rewards: rule-based scorers in a registry, user functions (callables or dotted
paths), a batch scorer that survives failing functions, and the reward-model hook.

Signature of a reward function::

    fn(response: str, ground_truth: str, *, prompt: str, meta: dict) -> float | dict

(a dict holds ``score`` and optional numeric extras such as ``acc``).
"""

from geartrain.rewards import rules
from geartrain.rewards.registry import REWARDS, RewardFn, RewardOutput, get_reward, register_reward
from geartrain.rewards.reward_model import sequence_scores_from_values
from geartrain.rewards.rules import gsm8k_answer, last_boxed, leading_integer, normalize_math
from geartrain.rewards.scoring import RewardResult, RewardScorer, score_batch, token_level_scores

__all__ = [
    "REWARDS",
    "RewardFn",
    "RewardOutput",
    "RewardResult",
    "RewardScorer",
    "get_reward",
    "gsm8k_answer",
    "last_boxed",
    "leading_integer",
    "normalize_math",
    "register_reward",
    "rules",
    "score_batch",
    "sequence_scores_from_values",
    "token_level_scores",
]
