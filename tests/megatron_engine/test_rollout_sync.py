"""Weight sync into the core's reference torch rollout: after two training steps and
``sync_weights``, the rollout holds exactly the engine's weights and its sampling log-probs
equal the engine's log-probs of the same tokens."""

from __future__ import annotations

import torch
from geartrain.config import RolloutConfig
from geartrain.rollout import Rollout
from geartrain.types import EngineContext, SamplingParams

from .common import Receiver, make_batch, make_engine, model_config, token_mean_loss


def test_torch_rollout_log_probs_equal_engine_after_sync() -> None:
    engine = make_engine("qwen2", 0, 1)
    for step in range(2):
        engine.forward_backward(make_batch(step), token_mean_loss)
        engine.optimizer_step()
    rollout = Rollout(
        RolloutConfig(backend="torch", weight_bucket_bytes=20_000), model_config("qwen2"), EngineContext(role="rollout")
    )
    stats = engine.sync_weights(rollout)
    assert stats.num_buckets > 1
    streamed = Receiver()
    engine.sync_weights(streamed)
    for name, tensor in rollout.handle.model.state_dict().items():
        sent = "model.embed_tokens.weight" if name == "lm_head.weight" else name  # tied: sent once
        assert torch.equal(tensor, streamed.tensors[sent]), name

    prompts = [[1, 40, 41, 42], [1, 50, 51], [1, 60, 61, 62, 63, 64]]
    sampled = rollout.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3))
    ours = engine.compute_log_probs(sampled).outputs["log_probs"]
    mask = sampled["response_mask"].bool()
    assert mask.sum() > 0
    torch.testing.assert_close(ours[mask], sampled["rollout_log_probs"][mask], atol=1e-4, rtol=0)
