"""Episodes in the trainer's pieces: SFT on multi-turn traces masks observations, the
``[rollout.agent]`` config and its checks, advantages over masked turns, and the rows the
trainer builds from a rank's share of tasks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from geartrain import EngineContext, ModelConfig, Rollout, RolloutConfig, SamplingParams
from geartrain.agents import AgentConfig, EpisodeRunner, RunnerLimits, StepResult, episode_batch
from geartrain.algorithms import compute_advantages
from geartrain.data import PromptBatch, PromptRow
from geartrain.errors import ConfigError
from geartrain.rewards import token_level_scores
from geartrain.testing.tiny import tiny_tokenizer
from geartrain.trainer.config import TrainConfig
from geartrain.trainer.episodes import annotate_episodes, episode_prompt_batch, render_sample, run_episode_share
from geartrain.trainer.sft import observation_renderer, sft_batch
from scripted_turns import scripted_generate

CALCULATOR = Path(__file__).resolve().parents[2] / "examples" / "calculator"


def test_sft_on_a_multi_turn_trace_masks_the_observation_tokens() -> None:
    tok = tiny_tokenizer()
    turns = [
        {"role": "model", "text": "[calc 12*3]"},
        {"role": "observation", "text": "(36)"},
        {"role": "model", "text": "36"},
    ]
    rows = [
        PromptRow(
            prompt_ids=tok.encode("12*3=", add_special_tokens=False),
            prompt="12*3=",
            ground_truth="36",
            meta={"turns": turns},
        )
    ]
    batch = sft_batch(rows, tok, "response")
    width = batch.info["prompt_length"]
    ids, loss = batch["input_ids"][0, width:].tolist(), batch["loss_mask"][0, width:].tolist()
    assert tok.decode(ids) == "[calc 12*3](36)36</s>"
    assert loss == [1] * len("[calc 12*3]") + [0] * len("(36)") + [1] * len("36") + [1]
    assert batch["loss_mask"][0, :width].sum() == 0


class _Scripted:
    """An environment that answers the trace's observations in order, then ends."""

    def __init__(self, observations: list[str]) -> None:
        self.observations = list(observations)

    def reset(self, task: dict) -> str:
        return ""

    def step(self, action: str) -> StepResult:
        if not self.observations:
            return StepResult(done=True)
        return StepResult(observation=self.observations.pop(0))


def test_sft_traces_render_observations_as_the_chat_templated_episodes_do() -> None:
    """With ``rollout.agent.chat_template`` the episodes render each observation as the
    template's bridge; the SFT warm start must teach that same text, not the raw
    observation: the trace's tokens and loss mask equal the episode runner's for the same
    turns (the model's turns scripted, the observations from an environment)."""
    tok = tiny_tokenizer()
    model_turns, observations = ["[calc 12*3]", "36"], ["(36)"]
    turns = [
        {"role": "model", "text": model_turns[0]},
        {"role": "observation", "text": observations[0]},
        {"role": "model", "text": model_turns[1]},
    ]
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "12*3="}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    row = PromptRow(prompt_ids=prompt, prompt="12*3=", ground_truth="36", meta={"turns": turns})
    agent = AgentConfig(environment="unused:Env", chat_template=True, observation_role="tool")
    render = observation_renderer(agent, tok)
    assert render is not None and observation_renderer(agent.model_copy(update={"chat_template": False}), tok) is None
    sft = sft_batch([row], tok, "response", render_observation=render)
    width = sft.info["prompt_length"]
    sft_ids, sft_loss = sft["input_ids"][0, width:].tolist(), sft["loss_mask"][0, width:].tolist()

    runner = EpisodeRunner(
        scripted_generate(tok, model_turns),
        tok,
        lambda: _Scripted(observations),
        RunnerLimits(max_turns=4, max_model_len=256),
        chat_template=True,
    )
    (ep,), _ = runner.run([prompt], [{}], SamplingParams(n=1, max_tokens=32))
    episode = episode_batch([ep], tok.pad_token_id)
    w = episode.info["prompt_length"]
    n = int(episode["attention_mask"][0, w:].sum())
    ep_ids, ep_mask = episode["input_ids"][0, w : w + n].tolist(), episode["response_mask"][0, w : w + n].tolist()
    eos = [tok.eos_token_id]
    assert sft_ids == ep_ids + eos  # the warm start ends its trace with EOS, as a finished episode's last turn would
    assert sft_loss == ep_mask + [1]
    assert "tool: (36)" in tok.decode(ep_ids)  # the bridge, not the raw observation


def test_a_trl_reward_on_conversational_episodes_gets_every_turn_as_messages() -> None:
    """TRL's tool loop hands a reward function the whole multi-turn completion: assistant
    messages and the tools' messages in order. An episode of a conversational row reaches a
    batched (TRL) reward function so, through the path a run takes (the episode rows,
    annotate_episodes, the reward worker); the prompt is the row's messages."""
    from geartrain import EngineContext as Ctx
    from geartrain.rewards import RewardResult
    from geartrain.rewards.terms import make_term
    from geartrain.trainer.roles import RewardWorker

    tok = tiny_tokenizer()
    model_turns, observations = ["[calc 12*3]", "36"], ["(36)"]

    question = [{"role": "user", "content": "12*3="}]
    prompt_ids = tok.encode(
        tok.apply_chat_template(question, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    row = PromptRow(prompt_ids=prompt_ids, prompt="12*3=", ground_truth="36", messages=question)
    prompts = PromptBatch(rows=[row], indices=[0], epoch=0)
    runner = EpisodeRunner(
        scripted_generate(tok, model_turns),
        tok,
        lambda: _Scripted(observations),
        RunnerLimits(max_turns=4, max_model_len=256),
    )
    (ep,), _ = runner.run([prompt_ids], [{}], SamplingParams(n=1, max_tokens=32))
    batch, _ = annotate_episodes(episode_batch([ep], tok.pad_token_id), prompts, 1)
    seen: dict[str, Any] = {}

    def trl_reward(prompts, completions, ground_truth, **kwargs):  # noqa: ANN001, ANN003, ANN202
        seen.update(prompts=prompts, completions=completions)
        return [float(c[-1]["content"] == g) for c, g in zip(completions, ground_truth, strict=True)]

    worker = RewardWorker([make_term(trl_reward)], None, None, ctx=Ctx(role="reward"))
    result = RewardResult.from_rows(worker.score(batch))
    assert seen["prompts"] == [question]
    assert seen["completions"] == [
        [
            {"role": "assistant", "content": "[calc 12*3]"},
            {"role": "tool", "content": "(36)"},
            {"role": "assistant", "content": "36"},
        ]
    ]
    assert result.scores.tolist() == [1.0]


def test_agent_config_and_its_checks() -> None:
    cfg = TrainConfig.model_validate({"rollout": {"agent": {"environment": "tools", "max_turns": 2}}})
    assert cfg.rollout.agent is not None and cfg.rollout.agent.max_turns == 2
    with pytest.raises(ConfigError, match="rollout.agent"):
        from geartrain.validation import load_config

        load_config(TrainConfig, None, ["rollout.agent.environment=tools", "trainer.async_rollout=true"])
    with pytest.raises(ConfigError, match=r"rollout.agent.max_turns"):
        from geartrain.validation import load_config

        load_config(TrainConfig, None, ["rollout.agent.environment=tools", "rollout.agent.max_turns=0"])


def test_grpo_advantages_cover_every_model_turn_and_skip_observations() -> None:
    """The sequence score sits on the last model token; every model token of the episode
    (all turns) gets the group-relative advantage, observation tokens none."""
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0], [0, 1, 0, 0, 1, 1, 1, 1]])
    rewards = token_level_scores(torch.tensor([1.0, 0.0]), mask)
    assert rewards[0].tolist() == [0, 0, 0, 0, 0, 0, 1, 0]
    advantages, _ = compute_advantages("grpo", rewards, mask, group_ids=["a", "a"])
    expected = torch.tensor([0.7071, -0.7071]).unsqueeze(1) * mask
    assert torch.allclose(advantages, expected, atol=1e-3)


def test_a_ranks_share_of_tasks_becomes_episode_rows_with_the_whole_episode_for_the_reward() -> None:
    tok = tiny_tokenizer()
    rollout = Rollout(
        RolloutConfig(backend="torch", max_model_len=48),
        ModelConfig(tiny="qwen2", seed=0),
        EngineContext(role="rollout"),
    )
    try:
        rows = [
            PromptRow(
                prompt_ids=[tok.bos_token_id, *tok.encode(p, add_special_tokens=False)],
                prompt=p,
                ground_truth="6",
                meta={"k": i},
            )
            for i, p in enumerate(["2*3=", "1*6="])
        ]
        prompts = PromptBatch(rows=rows, indices=[0, 1], epoch=0)
        share = episode_prompt_batch(prompts)
        assert share["task"][1] == {"k": 1, "prompt": "1*6=", "ground_truth": "6"}
        agent = AgentConfig(
            environment=str(CALCULATOR / "calculator.py") + ":Calculator", max_turns=2, max_tokens_per_turn=6
        )
        sampling = SamplingParams(n=3, temperature=1.0, seed=3, stop_token_ids=[tok.eos_token_id])
        batch, _ = run_episode_share(rollout.generate, tok, share, sampling, agent, base_dir=None, max_model_len=48)
        assert len(batch) == 6 and batch["prompt_index"] == [0, 0, 0, 1, 1, 1]
        # the same episodes when this rank holds only the second task (placement invariance)
        alone, _ = run_episode_share(
            rollout.generate, tok, share.index([1]), sampling, agent, base_dir=None, max_model_len=48
        )

        def real(b, r):  # a row's tokens, padding removed
            return b["input_ids"][r][b["attention_mask"][r].bool()].tolist()

        assert [real(batch, 3 + r) for r in range(3)] == [real(alone, r) for r in range(3)]
        annotated, metrics = annotate_episodes(batch, prompts, 3)
        for r in range(6):
            record = annotated["data_meta"][r]["episode"]
            last_model = [t["text"] for t in record["turns"] if t["role"] == "model"][-1]
            assert annotated["response_text"][r] == last_model
            assert annotated["data_meta"][r]["k"] == r // 3
        assert metrics["agent/turns_mean"] >= 1.0
        assert "[task] '2*3='" in render_sample(annotated, 0)
    finally:
        rollout.shutdown()


def test_length_normalised_losses_use_the_episode_budget() -> None:
    from geartrain.trainer.loss_config import actor_loss_config, critic_loss_config

    plain = TrainConfig.model_validate({"sampling": {"max_tokens": 16}})
    agent = TrainConfig.model_validate(
        {"sampling": {"max_tokens": 16}, "rollout": {"agent": {"environment": "tools", "max_episode_tokens": 48}}}
    )
    assert actor_loss_config(plain).norm_length == 16
    assert actor_loss_config(agent).norm_length == 48 and critic_loss_config(agent).norm_length == 48
