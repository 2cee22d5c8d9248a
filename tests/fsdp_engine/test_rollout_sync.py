"""Weight sync into the core's reference torch rollout: after one training step and
``sync_weights``, the rollout samples with the engine's weights (its log-probs equal the
engine's within 1e-5) and holds exactly the engine's full tensors."""

from __future__ import annotations

import torch
from geartrain.config import ModelConfig, RolloutConfig
from geartrain.rollout import Rollout
from geartrain.types import EngineContext, SamplingParams

from .common import full_params, make_batch, make_engine, token_mean_loss


def test_hook_reshard_for_rollout_torch_rollout_log_probs_equal_engine_after_sync() -> None:
    engine = make_engine("qwen2", lr=5e-3)
    for step in range(2):
        engine.forward_backward(make_batch(step), token_mean_loss)
        engine.optimizer_step()
    rollout = Rollout(
        RolloutConfig(backend="torch", weight_bucket_bytes=20_000),
        ModelConfig(tiny="qwen2"),
        EngineContext(role="rollout"),
    )
    stats = engine.sync_weights(rollout)
    assert stats.num_buckets > 1
    weights = full_params(engine)
    for name, tensor in rollout.handle.model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name

    prompts = [[1, 40, 41, 42], [1, 50, 51], [1, 60, 61, 62, 63, 64]]
    sampled = rollout.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3))
    ours = engine.compute_log_probs(sampled).outputs["log_probs"]
    mask = sampled["response_mask"].bool()
    assert mask.sum() > 0
    assert torch.allclose(ours[mask], sampled["rollout_log_probs"][mask], atol=1e-5, rtol=0)
