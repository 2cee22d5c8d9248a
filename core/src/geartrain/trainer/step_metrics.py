"""What an RL step logs about its batch, computed from the batch alone.

The step's stages add their own measurements (the rollout's ``timing/generate_s`` and
``hybrid/*``, the reward's ``reward/*``, the updates' ``actor/*`` and ``critic/*``); the
functions here derive the rest from the batch's keys (see :mod:`geartrain.types`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from geartrain.algorithms import kl_estimate, masked_mean, mismatch_metrics, truncated_is_weights
from geartrain.batch import Batch


@contextmanager
def timed(metrics: dict[str, float], key: str) -> Iterator[None]:
    """Record the seconds the block took under ``metrics[key]``."""
    start = time.perf_counter()
    yield
    metrics[key] = time.perf_counter() - start


def reward_metrics(batch: Batch) -> dict[str, float]:
    """``reward/std`` of the sequence scores, ``reward/accuracy`` (share ``correct``) and
    ``reward/max_abs`` (the largest score's magnitude, ``inf``/``nan`` when one is not
    finite: what the watchdog reads to name scores that overflow)."""
    scores = torch.as_tensor(batch["score"])
    correct = torch.as_tensor(batch["correct"])
    max_abs = float(scores.abs().max()) if len(scores) else 0.0  # inf/nan propagate
    if len(scores) and bool(scores.isnan().any()):
        max_abs = float("nan")
    return {
        "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
        "reward/accuracy": float(correct.mean()),
        "reward/max_abs": max_abs,
    }


def policy_metrics(batch: Batch, entropy: torch.Tensor | None) -> dict[str, Any]:
    """From the old log-probs: the mean token ``actor/entropy`` (when given), the
    rollout-vs-trainer mismatch (``rollout_mismatch/*``) and, with a reference,
    ``actor/ref_kl`` (k3, token mean)."""
    mask = batch["response_mask"]
    metrics: dict[str, Any] = {}
    if entropy is not None:
        metrics["actor/entropy"] = float(masked_mean(entropy, mask))
    metrics.update(mismatch_metrics(batch["old_log_probs"], batch["rollout_log_probs"], mask))
    if "ref_log_probs" in batch:
        kl = kl_estimate(batch["old_log_probs"], batch["ref_log_probs"], "k3")
        metrics["actor/ref_kl"] = float(masked_mean(kl, mask))
    return metrics


def off_policy_metrics(batch: Batch, is_cap: float | None) -> dict[str, Any]:
    """Async rollout: per-sample staleness and mean truncated IS weight (the correction the
    loss applied, ``min(exp(old - rollout), cap)`` over the response), plus summaries."""
    mask = batch["response_mask"]
    staleness = batch["staleness"]
    record: dict[str, Any] = {
        "async/staleness_mean": float(staleness.mean()),
        "async/staleness_max": float(staleness.max()),
        "samples/staleness": [int(s) for s in staleness.tolist()],
    }
    if is_cap is not None and "old_log_probs" in batch:
        weights = truncated_is_weights(batch["old_log_probs"], batch["rollout_log_probs"], mask, cap=is_cap)
        per_sample = (weights * mask).sum(1) / mask.sum(1).clamp(min=1)
        record["async/is_weight_mean"] = float(masked_mean(weights, mask))
        record["async/is_weight_capped"] = float(masked_mean((weights >= is_cap).float(), mask))
        record["samples/is_weight"] = [round(w, 6) for w in per_sample.tolist()]
    return record


def response_metrics(batch: Batch, *, step_s: float, generate_s: float) -> dict[str, float]:
    """Response lengths, the share cut at the length limit, and throughput: all tokens per
    second of the step, generated tokens per second of generation; with ``sampling.stop``,
    the share of responses cut at a stop string the rollout did not stop on (spelled with
    other tokens than its encoding: generation past it was wasted)."""
    mask = batch["response_mask"]
    lengths = mask.sum(-1).float()
    tokens = float(batch["attention_mask"].sum())
    record = {
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/clip_ratio": sum(r == "length" for r in batch["finish_reason"]) / len(batch),
        "timing/step_s": step_s,
        "perf/tokens": tokens,
        "perf/tokens_per_s": tokens / max(step_s, 1e-9),
        "perf/generated_tokens_per_s": float(mask.sum()) / max(generate_s, 1e-9),
    }
    if "stop_text_cut" in batch:
        record["response/stop_text_cut_ratio"] = sum(map(bool, batch["stop_text_cut"])) / len(batch)
    return record
