"""The reward-model role's hook: from a value-head forward to one score per sequence.

The trainer runs a value-head engine (``ModelConfig.value_head``) forward-only over the
batch and passes its ``values`` output here.

Alignment (see :mod:`geartrain.types`): ``values[:, t] = V(x_<t)``, so the entry at the
last response token is the head's output *before* reading that token. To score a whole
sequence including its final token, append one token (e.g. EOS or pad) after each
response, with ``response_mask`` 1 on it, before the forward; its entry is then the
output after reading every original token.
"""

from __future__ import annotations

import torch


def sequence_scores_from_values(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The value at each row's last response token: ``[B, T] -> [B]`` (float32).

    Rows with an empty mask score 0.
    """
    mask = response_mask.bool()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values
    picked = values.gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1).float()
    return torch.where(last >= 0, picked, torch.zeros_like(picked))
