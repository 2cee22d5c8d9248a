"""Scoring a batch of responses with a reward function, robust to a function that fails.

A sample whose function raises, returns a non-finite score, or returns something that is
not a number or a dict with a numeric ``score`` gets reward 0; it is counted in
``reward/errors`` and the run goes on. The first failure of a call is logged (logger
``geartrain.rewards``, WARNING, with the sample and the traceback); further failures of
the same call are summed up in one more line.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

import torch

from geartrain.rewards.registry import RewardFn, RewardOutput, get_reward

logger = logging.getLogger("geartrain.rewards")


@dataclass(kw_only=True, slots=True)
class RewardResult:
    """Scores of a batch.

    ``scores`` ``[B]`` float32; ``extras[key]`` one entry per sample (``None`` where the
    function gave none) for the numeric extras of dict outputs (``acc``...); ``errors``
    the indices of failed samples; ``metrics``: ``reward/mean``, ``reward/errors`` and
    ``reward/<extra>`` (mean over samples that reported it).
    """

    scores: torch.Tensor
    extras: dict[str, list[float | None]] = field(default_factory=dict)
    errors: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


class _BadOutput(ValueError):
    pass


def _parse(output: RewardOutput) -> tuple[float, dict[str, float]]:
    if isinstance(output, Mapping):
        if "score" not in output:
            raise _BadOutput(f"reward dict has no 'score' key (keys: {sorted(output)})")
        score, extras = output["score"], {k: v for k, v in output.items() if k != "score"}
    else:
        score, extras = output, {}
    if isinstance(score, torch.Tensor) and score.numel() == 1:
        score = score.item()
    if not isinstance(score, Real):
        raise _BadOutput(f"reward score is {type(score).__name__}, not a number")
    score = float(score)
    if not math.isfinite(score):
        raise _BadOutput(f"reward score is not finite ({score})")
    numeric = {k: float(v) for k, v in extras.items() if isinstance(v, Real) and math.isfinite(float(v))}
    return score, numeric


def score_batch(
    fn: RewardFn | Callable[..., RewardOutput] | str,
    responses: Sequence[str],
    ground_truths: Sequence[Any],
    *,
    prompts: Sequence[str] | None = None,
    metas: Sequence[Mapping[str, Any] | None] | None = None,
) -> RewardResult:
    """Call ``fn`` (anything :func:`get_reward` accepts) once per sample.

    ``ground_truths`` entries are passed as ``str`` (``None`` as ``""``); ``prompts``
    default to ``""`` and ``metas`` to ``{}``.
    """
    reward = get_reward(fn)
    n = len(responses)
    prompts = list(prompts) if prompts is not None else [""] * n
    metas = list(metas) if metas is not None else [None] * n
    if not (len(ground_truths) == len(prompts) == len(metas) == n):
        raise ValueError(
            f"score_batch needs one entry per response: {n} responses, {len(ground_truths)} ground truths, "
            f"{len(prompts)} prompts, {len(metas)} metas"
        )
    scores = [0.0] * n
    extras: dict[str, list[float | None]] = {}
    errors: list[int] = []
    name = getattr(reward, "__name__", repr(reward))
    for i in range(n):
        truth = "" if ground_truths[i] is None else str(ground_truths[i])
        try:
            score, numeric = _parse(reward(responses[i], truth, prompt=prompts[i], meta=dict(metas[i] or {})))
        except Exception as exc:  # a user function's bug must not stop the run
            if not errors:
                logger.warning(
                    "reward function %s failed on sample %d (reward 0; further failures of this batch are counted): "
                    "%s: %s\n  prompt=%r\n  response=%r\n  ground_truth=%r",
                    name,
                    i,
                    type(exc).__name__,
                    exc,
                    prompts[i][:500],
                    responses[i][:500],
                    truth[:200],
                    exc_info=not isinstance(exc, _BadOutput),
                )
            errors.append(i)
            continue
        scores[i] = score
        for key, value in numeric.items():
            extras.setdefault(key, [None] * n)[i] = value
    if len(errors) > 1:
        logger.warning("reward function %s failed on %d of %d samples (rows %s)", name, len(errors), n, errors[:20])
    metrics = {"reward/mean": sum(scores) / n if n else 0.0, "reward/errors": float(len(errors))}
    for key, values in extras.items():
        present = [v for v in values if v is not None]
        metrics[f"reward/{key}"] = sum(present) / len(present)
    return RewardResult(scores=torch.tensor(scores, dtype=torch.float32), extras=extras, errors=errors, metrics=metrics)


def token_level_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence score ``[B]`` on its last response token: ``[B, T]`` float32,
    0 elsewhere (rows with an empty mask get nothing). This is the ``token_rewards`` input
    of the advantage estimators."""
    mask = response_mask.bool()
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = scores.to(device=mask.device, dtype=torch.float32)[rows]
    return out
