"""IcePop-style masked importance sampling: tokens whose rollout-vs-trainer weight leaves
``[low, high]`` drop out of the policy gradient (instead of being capped), hand-computed."""

from __future__ import annotations

import math

import torch
from geartrain.algorithms import masked_is_weights
from geartrain.algorithms.losses import ActorLossConfig, make_actor_loss
from geartrain.batch import Batch
from geartrain.types import LossContext

# weights exp(old - rollout): 1, e^1 (> 2), e^-1 (0.37 < 0.5), 1.5; the last token is padding
OLD = torch.tensor([[0.0, 1.0, -1.0, math.log(1.5), 0.0]])
ROLLOUT = torch.zeros(1, 5)
MASK = torch.tensor([[1, 1, 1, 1, 0]])


def test_masked_weights_keep_only_the_tokens_inside_the_band() -> None:
    w = masked_is_weights(OLD, ROLLOUT, MASK, low=0.5, high=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 0.0, 0.0, 1.5, 0.0]]))


def _grad(correction: str) -> torch.Tensor:
    log_probs = OLD.clone().requires_grad_(True)  # on-policy w.r.t. old: ratio 1
    batch = Batch(
        {"loss_mask": MASK, "old_log_probs": OLD, "rollout_log_probs": ROLLOUT, "advantages": torch.ones(1, 5)}
    )
    loss_fn = make_actor_loss(ActorLossConfig(tis_cap=2.0, is_correction=correction, is_mask_low=0.5))
    loss, _ = loss_fn({"log_probs": log_probs}, batch, LossContext(global_tokens=4, global_sequences=1))
    loss.backward()
    return log_probs.grad


def test_the_actor_loss_masks_or_truncates_per_token() -> None:
    # token-mean over 4 tokens of -A * ratio * w: d/dlogp = -w / 4
    assert torch.allclose(_grad("mask"), -torch.tensor([[1.0, 0.0, 0.0, 1.5, 0.0]]) / 4)
    assert torch.allclose(_grad("truncate"), -torch.tensor([[1.0, 2.0, math.exp(-1.0), 1.5, 0.0]]) / 4)
