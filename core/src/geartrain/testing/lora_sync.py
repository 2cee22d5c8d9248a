"""Adapters trained by a LoRA engine reach a real rollout, in both sync modes: the check a
rollout backend that declares ``lora`` runs against an engine that trains adapters.

:func:`lora_sync_gaps` trains a few steps of rank-``rank`` adapters on ``model`` with the
``engine`` backend, syncs them to ``rollout`` (twice: the first adapter-only sync also sends
the base), samples, and measures the largest gap between the rollout's log-probs of its
samples and the engine's, and the gap to the base's (adapters off), per mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from geartrain.cluster.process_group import acquire_single_rank_group
from geartrain.config import EngineConfig, LoraConfig, ModelConfig, OptimConfig
from geartrain.engine import Engine
from geartrain.rollout import Rollout
from geartrain.testing.reference import make_batch, token_mean_nll_loss
from geartrain.testing.rollout_suite import encode_prompts
from geartrain.types import EngineContext, SamplingParams, SyncStats

#: the sync modes of ``actor.lora.sync``
SYNC_MODES = ("merged", "adapter")


def trained_lora_engine(
    model: ModelConfig, sync: str, *, backend: str = "fsdp", rank: int = 8, steps: int = 3
) -> Engine:
    """An engine whose rank-``rank`` adapters (alpha ``2 rank``) trained ``steps`` NLL steps
    at a learning rate high enough to move the log-probs visibly."""
    lora = LoraConfig(rank=rank, alpha=2 * rank, sync=sync)  # type: ignore[arg-type]
    config = EngineConfig(backend=backend, optim=OptimConfig(lr=2e-2, clip_grad=1.0), lora=lora)
    engine = Engine(config, model, EngineContext(role="actor", process_group=acquire_single_rank_group("cpu")))
    for step in range(steps):
        engine.forward_backward(make_batch([4, 6, 3], [7, 5, 8], seed=step), token_mean_nll_loss)
        engine.optimizer_step()
    return engine


@dataclass
class LoraSyncGaps:
    """Per sync mode: the largest |rollout - engine| log-prob over the sampled tokens
    (``trained``), the same against the base with adapters off (``base``), and the
    :class:`SyncStats` of the two syncs (``syncs``)."""

    trained: dict[str, float] = field(default_factory=dict)
    base: dict[str, float] = field(default_factory=dict)
    syncs: dict[str, list[SyncStats]] = field(default_factory=dict)


def lora_sync_gaps(rollout: Rollout, model: ModelConfig, *, backend: str = "fsdp", rank: int = 8) -> LoraSyncGaps:
    """See the module docstring. ``rollout`` must serve ``model`` and accept adapters of
    ``rank`` (``rollout.max_lora_rank``); a fresh engine is trained for each mode."""
    gaps = LoraSyncGaps()
    prompts, sampling = encode_prompts(), SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=3)
    for sync in SYNC_MODES:
        engine = trained_lora_engine(model, sync, backend=backend, rank=rank)
        gaps.syncs[sync] = [engine.sync_weights(rollout), engine.sync_weights(rollout)]
        sampled = rollout.generate(prompts, sampling)
        mask = sampled["response_mask"].bool()
        rolled = sampled["rollout_log_probs"][mask]
        trained = engine.compute_log_probs(sampled).outputs["log_probs"][mask]
        base = engine.compute_log_probs(sampled, adapters_off=True).outputs["log_probs"][mask]
        gaps.trained[sync] = float((trained - rolled).abs().max())
        gaps.base[sync] = float((base - rolled).abs().max())
    return gaps
