"""Scoring a batch of responses with a reward function, robust to a function that fails.

A sample whose function raises, returns a non-finite score, or returns something that is
not a number or a dict with a numeric ``score`` gets reward 0; it is counted in
``reward/errors`` and the run goes on; so does a sample whose batch ran past
``timeout_s`` (also counted in ``reward/timeouts``). A :class:`RewardScorer` logs its first
failure (logger ``geartrain.rewards``, WARNING, with the sample and the traceback) and its
first timeout once; after that they are only counted.
"""

from __future__ import annotations

import logging
import math
import threading
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


class RewardScorer:
    """Scores batches with one reward function over a run.

    ``timeout_s`` bounds the time one batch's calls may take together: when it runs out,
    the call in progress and the samples not yet scored get reward 0 and are counted in
    ``reward/timeouts`` (and ``reward/errors``), and the run goes on. (A Python thread
    cannot be killed: a call that hangs forever keeps its daemon thread.) The first
    failure and the first timeout of the scorer's life are logged in full, with the
    traceback; later ones are only counted, in the metrics.
    """

    def __init__(self, fn: RewardFn | Callable[..., RewardOutput] | str, *, timeout_s: float | None = None) -> None:
        self.reward = get_reward(fn)
        self.name = getattr(self.reward, "__name__", repr(self.reward))
        self.timeout_s = timeout_s
        self._failure_logged = False
        self._timeout_logged = False

    def _call(self, responses: Sequence[str], truths: list[str], prompts: Sequence[str], metas: Sequence[Any], i: int) -> tuple[float, dict[str, float]] | BaseException:
        try:
            return _parse(self.reward(responses[i], truths[i], prompt=prompts[i], meta=dict(metas[i] or {})))
        except Exception as exc:  # a user function's bug must not stop the run
            return exc

    def _run(self, n: int, call: Callable[[int], Any]) -> list[Any]:
        """``call(i)`` for each sample; the results before the deadline, in order."""
        if self.timeout_s is None:
            return [call(i) for i in range(n)]
        results: list[Any] = []
        lock = threading.Lock()
        stop = threading.Event()
        done = threading.Event()

        def work() -> None:
            for i in range(n):
                out = call(i)
                with lock:
                    if stop.is_set():
                        return
                    results.append(out)
            done.set()

        threading.Thread(target=work, name=f"geartrain-reward-{self.name}", daemon=True).start()
        finished = done.wait(self.timeout_s)
        with lock:
            if not finished:
                stop.set()
            return list(results)

    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        *,
        prompts: Sequence[str] | None = None,
        metas: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> RewardResult:
        """Call the function once per sample (see :func:`score_batch`)."""
        n = len(responses)
        prompts = list(prompts) if prompts is not None else [""] * n
        metas = list(metas) if metas is not None else [None] * n
        if not (len(ground_truths) == len(prompts) == len(metas) == n):
            raise ValueError(
                f"score_batch needs one entry per response: {n} responses, {len(ground_truths)} ground truths, "
                f"{len(prompts)} prompts, {len(metas)} metas"
            )
        truths = ["" if t is None else str(t) for t in ground_truths]
        results = self._run(n, lambda i: self._call(responses, truths, prompts, metas, i))
        scores = [0.0] * n
        extras: dict[str, list[float | None]] = {}
        errors: list[int] = []
        first_failure = True
        logged_now = False
        for i, out in enumerate(results):
            if isinstance(out, BaseException):
                if not self._failure_logged:
                    logger.warning(
                        "reward function %s failed on sample %d (reward 0; this traceback is logged once, further "
                        "failures are counted in reward/errors): %s: %s\n  prompt=%r\n  response=%r\n  ground_truth=%r",
                        self.name,
                        i,
                        type(out).__name__,
                        out,
                        prompts[i][:500],
                        responses[i][:500],
                        truths[i][:200],
                        exc_info=(type(out), out, out.__traceback__) if not isinstance(out, _BadOutput) else None,
                    )
                    self._failure_logged = logged_now = True
                elif first_failure:
                    logger.debug("reward function %s failed on sample %d: %s: %s", self.name, i, type(out).__name__, out)
                first_failure = False
                errors.append(i)
                continue
            score, numeric = out
            scores[i] = score
            for key, value in numeric.items():
                extras.setdefault(key, [None] * n)[i] = value
        failed_calls = len(errors)
        timed_out = list(range(len(results), n))
        if timed_out:
            level = logging.DEBUG if self._timeout_logged else logging.WARNING
            logger.log(
                level,
                "reward function %s timed out: reward.timeout_s = %ss for the batch ran out at sample %d of %d; it and "
                "the %d samples after it score 0 (counted in reward/timeouts; later timeouts are only counted)",
                self.name, self.timeout_s, timed_out[0], n, len(timed_out) - 1,
            )
            self._timeout_logged = True
            errors.extend(timed_out)
        if logged_now and failed_calls > 1:
            logger.warning("reward function %s failed on %d of %d samples (rows %s)", self.name, failed_calls, n, errors[:20])
        metrics = {
            "reward/mean": sum(scores) / n if n else 0.0,
            "reward/errors": float(len(errors)),
            "reward/timeouts": float(len(timed_out)),
            "reward/error_fraction": len(errors) / n if n else 0.0,
        }
        for key, values in extras.items():
            present = [v for v in values if v is not None]
            metrics[f"reward/{key}"] = sum(present) / len(present)
        return RewardResult(scores=torch.tensor(scores, dtype=torch.float32), extras=extras, errors=errors, metrics=metrics)


def score_batch(
    fn: RewardFn | Callable[..., RewardOutput] | str,
    responses: Sequence[str],
    ground_truths: Sequence[Any],
    *,
    prompts: Sequence[str] | None = None,
    metas: Sequence[Mapping[str, Any] | None] | None = None,
    timeout_s: float | None = None,
) -> RewardResult:
    """Call ``fn`` (anything :func:`get_reward` accepts) once per sample, with a fresh
    :class:`RewardScorer` (so its first failure is logged).

    ``ground_truths`` entries are passed as ``str`` (``None`` as ``""``); ``prompts``
    default to ``""`` and ``metas`` to ``{}``.
    """
    return RewardScorer(fn, timeout_s=timeout_s).score(responses, ground_truths, prompts=prompts, metas=metas)


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
