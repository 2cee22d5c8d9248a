"""Multi-turn episodes through the FSDP engine: the trainer's log-probs of the model's
tokens equal the torch rollout's, with the shared-prompt prefix (the task prompt, shared by
a task's episodes) and without, and the loss over the masked layout is the token mean of the
model's tokens only."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from geartrain import EngineContext, ModelConfig, Rollout, RolloutConfig, SamplingParams
from geartrain.agents import EpisodeRunner, RunnerLimits, StepResult, episode_batch
from geartrain.testing.tiny import tiny_tokenizer

from .common import make_engine, token_mean_loss


class Feedback:
    """Three turns, each answered with a short observation."""

    def __init__(self) -> None:
        self.k = 0

    def reset(self, task: dict[str, Any]) -> str:
        return ""

    def step(self, action: str) -> StepResult:
        self.k += 1
        return StepResult(done=self.k >= 3, observation=f"<{self.k}>")


@pytest.fixture(scope="module")
def episodes_batch() -> Any:
    torch.set_num_threads(1)
    tok = tiny_tokenizer()
    rollout = Rollout(
        RolloutConfig(backend="torch", max_model_len=64),
        ModelConfig(tiny="qwen2", seed=0),
        EngineContext(role="rollout"),
    )
    try:
        runner = EpisodeRunner(
            rollout.generate, tok, Feedback, RunnerLimits(max_turns=3, max_tokens_per_turn=5, max_model_len=64)
        )
        tasks = [f"task {i}:" for i in range(3)]
        n = 3
        prompts = [[tok.bos_token_id, *tok.encode(t, add_special_tokens=False)] for t in tasks for _ in range(n)]
        episodes, _ = runner.run(
            prompts,
            [{} for _ in prompts],
            SamplingParams(temperature=1.0, seed=11, stop_token_ids=[tok.eos_token_id]),
            groups=[i for i in range(3) for _ in range(n)],
        )
    finally:
        rollout.shutdown()
    batch = episode_batch(episodes, tok.pad_token_id)
    batch["loss_mask"] = batch["response_mask"]
    assert all(e.model_turns == 3 for e in episodes)
    return batch


@pytest.mark.parametrize("share", [True, False], ids=["shared-prompt", "packed-rows"])
def test_fsdp_log_probs_of_episodes_equal_the_rollouts(episodes_batch: Any, share: bool) -> None:
    engine = make_engine(budget=10_000, options={"share_prompt_prefix": share})
    out = engine.compute_log_probs(episodes_batch.clone()).outputs["log_probs"]
    mask = episodes_batch["response_mask"].bool()
    err = float((out - episodes_batch["rollout_log_probs"])[mask].abs().max())
    assert err < 1e-5, err


def test_fsdp_loss_on_episodes_is_the_mean_over_model_tokens(episodes_batch: Any) -> None:
    engine = make_engine(budget=10_000)
    out = engine.forward_backward(episodes_batch.clone(), token_mean_loss)
    mask = episodes_batch["response_mask"].bool()
    expected = -float(episodes_batch["rollout_log_probs"][mask].mean())
    assert out.metrics["loss"] == pytest.approx(expected, abs=1e-5)
