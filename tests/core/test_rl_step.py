"""RLTrainer.step's plumbing, with the recording fake engine and rollout
(geartrain.testing.fakes): which keys each role receives, the order of the calls (the
hybrid switch), how each call is dispatched, and the metrics, against values worked out by
hand. The roles are the trainer's real ones (Job.build_roles over inline worker groups); only
the backends are fakes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from geartrain.cluster import Dispatch
from geartrain.config import EngineConfig, OptimConfig, RolloutConfig
from geartrain.data import DataConfig, PromptDataset, PromptLoader
from geartrain.modeling import tiny_tokenizer
from geartrain.testing.fakes import FakeBackends, GroupCall, RecordingWorkerGroup
from geartrain.trainer.config import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    RewardConfig,
    RoleEngine,
    SamplingConfig,
    TrainConfig,
    TrainerConfig,
)
from geartrain.trainer.rl import RLRoles, RLTrainer
from geartrain.trainer.run import Job

PROMPTS, N, MAX_TOKENS = 2, 3, 3
# what the rollout returns, then what the trainer adds before anyone computes on it
ROLLOUT_KEYS = {"input_ids", "attention_mask", "response_mask", "rollout_log_probs", "prompt_index", "finish_reason"}
SCORED_KEYS = ROLLOUT_KEYS | {
    "rollout_rank",
    "prompt",
    "ground_truth",
    "data_meta",
    "prompt_messages",
    "uid",
    "response_text",
    "loss_mask",
    "score",
    "correct",
    "reward_terms",
}
ADVANTAGE_KEYS = {"advantages", "returns"}


def length_reward(response: str, ground_truth: str) -> float:
    """The response's length in characters (= tokens with the character tokenizer)."""
    return float(len(response))


@pytest.fixture
def fakes() -> Iterator[FakeBackends]:
    with FakeBackends().registered() as backends:
        yield backends
    for group in _open_groups:  # frees each inline role's process group
        group.shutdown()
    _open_groups.clear()


_open_groups: list[RecordingWorkerGroup] = []


def fake_engine(lr: float) -> RoleEngine:
    return RoleEngine(engine=EngineConfig(backend="fake", optim=OptimConfig(lr=lr, weight_decay=0.0)))


def build(
    tmp_path: Path, algorithm: AlgorithmConfig, *, free_memory: bool, reuse: bool = True
) -> tuple[RLTrainer, list[GroupCall]]:
    config = TrainConfig(
        algorithm=algorithm,
        actor=ActorConfig(engine=fake_engine(0.1).engine),
        reference=fake_engine(0.0),
        critic=CriticConfig(engine=EngineConfig(backend="fake", optim=OptimConfig(lr=0.2, weight_decay=0.0))),
        rollout=RolloutConfig(backend="fake", max_model_len=64),
        sampling=SamplingConfig(n=N, max_tokens=MAX_TOKENS),
        reward=RewardConfig(function="arithmetic"),
        trainer=TrainerConfig(
            output_dir=str(tmp_path), free_memory=free_memory, progress=False, reuse_update_log_probs=reuse
        ),
    )
    tokenizer = tiny_tokenizer()
    rows = [{"prompt": f"{i}+1=", "ground_truth": str(i + 1)} for i in range(PROMPTS)]
    dataset = PromptDataset(rows, tokenizer, DataConfig(apply_chat_template=False, batch_size=PROMPTS))
    loader = PromptLoader(dataset, PROMPTS, shuffle=False)
    roles = Job(config, reward_fn=length_reward).build_roles(config.model)
    log: list[GroupCall] = []
    wrap = lambda g: RecordingWorkerGroup(g, log) if g is not None else None  # noqa: E731
    recorded = RLRoles(
        actor=wrap(roles.actor), reward=wrap(roles.reward), reference=wrap(roles.reference), critic=wrap(roles.critic)
    )
    _open_groups.extend(
        g for g in (recorded.actor, recorded.reward, recorded.reference, recorded.critic) if g is not None
    )
    return RLTrainer(config, recorded, tokenizer, loader), log


def by_hand_lengths() -> list[int]:
    """The fake rollout's response lengths, prompt-major: 1 + (i + j) % max_tokens."""
    return [1 + (i + j) % MAX_TOKENS for i in range(PROMPTS) for j in range(N)]


def test_grpo_step_calls_keys_dispatch_and_metrics(tmp_path: Path, fakes: FakeBackends) -> None:
    # the separate old-log-prob forward (reuse off); the next test covers the reuse
    trainer, log = build(tmp_path, AlgorithmConfig(name="grpo"), free_memory=False, reuse=False)
    # a rule reward and GRPO without KL build no reference, critic or reward engine
    assert [(c.role, c.hook) for c in fakes.calls] == [
        ("actor", "build_model"),
        ("actor", "shard"),
        ("rollout", "build_rollout"),
    ]
    fakes.clear()
    metrics = trainer.step(1)

    assert [(c.role, c.hook) for c in fakes.calls] == [
        ("actor", "reshard_for_rollout"),
        ("rollout", "update_weights"),
        ("rollout", "generate"),
        ("actor", "forward_backward"),  # old log-probs
        ("actor", "forward_backward"),  # the update
        ("actor", "optimizer_step"),
    ]
    assert log == [
        GroupCall(role="actor", method="generate", dispatch=Dispatch.DP),
        GroupCall(role="reward", method="score", dispatch=Dispatch.DP),
        GroupCall(role="actor", method="compute_log_probs", dispatch=Dispatch.DP),
        GroupCall(role="actor", method="update", dispatch=Dispatch.DP),
    ]
    generate = fakes.of("rollout", "generate")[0]
    assert generate.detail == {"prompts": PROMPTS, "n": N, "seed": generate.detail["seed"]}
    old, update = fakes.of("actor", "forward_backward")
    assert (old.keys, old.rows, old.detail) == (
        SCORED_KEYS,
        PROMPTS * N,
        {"forward_only": True, "loss": False, "need_entropy": True},
    )
    assert (update.keys, update.rows) == (SCORED_KEYS | {"old_log_probs"} | ADVANTAGE_KEYS, PROMPTS * N)
    assert update.detail == {"forward_only": False, "loss": True, "need_entropy": False}

    # GRPO advantages by hand: rewards are the lengths [1, 2, 3 | 2, 3, 1], each group has
    # mean 2 and std 1, so every response token of a sample carries (length - 2)
    lengths = by_hand_lengths()
    mask = update.batch["response_mask"].bool()
    for row, length in enumerate(lengths):
        assert mask[row].sum() == length
        torch.testing.assert_close(
            update.batch["advantages"][row][mask[row]], torch.full((length,), length - 2.0), atol=1e-5, rtol=0
        )

    # metrics by hand (see the fakes' closed forms)
    assert metrics["hybrid/weight_sync_bytes"] == 4.0 and metrics["hybrid/weight_sync_buckets"] == 1.0  # theta, fp32
    assert metrics["reward/mean"] == pytest.approx(2.0) and metrics["reward/std"] == pytest.approx(0.8**0.5)
    assert metrics["response/length_mean"] == 2.0 and metrics["response/length_max"] == 3.0
    assert metrics["response/clip_ratio"] == pytest.approx(2 / 6)  # two responses hit max_tokens
    assert metrics["actor/entropy"] == 1.0
    # old log-probs - rollout's = -0.01 * (token % 10); response tokens % 10 sum to 27 over 12
    assert metrics["rollout_mismatch/mean_abs_diff"] == pytest.approx(0.0225, abs=1e-6)
    # ratio 1: pg_loss = -token-mean(advantage) = -(2 + 2) / 12, and d/dtheta of it is +1/3
    assert metrics["actor/pg_loss"] == pytest.approx(-1 / 3, abs=1e-6)
    assert metrics["actor/grad_norm"] == pytest.approx(1 / 3, abs=1e-6)
    assert metrics["actor/lr"] == pytest.approx(0.1) and metrics["actor/skipped"] == 0.0
    assert metrics["perf/tokens"] == 6 * 4 + sum(lengths)  # 4-character prompts

    # the next step syncs the updated weights first: AdamW's first step moved theta by -lr
    fakes.clear()
    trainer.step(2)
    assert fakes.hooks()[:3] == ["reshard_for_rollout", "update_weights", "generate"]
    assert fakes.of("actor", "reshard_for_rollout")[0].detail["theta"] == pytest.approx(0.4, abs=1e-6)


def test_routing_of_the_old_log_prob_forward_reaches_the_update(
    tmp_path: Path, fakes: FakeBackends, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine with MoE router replay returns ``routed_experts`` from the old-log-prob
    forward; the trainer puts it into the batch, so the update (every mini-batch row) gets
    the very routing that forward used."""
    from geartrain.testing import fakes as fakes_module

    plain = fakes_module.fake_outputs

    def with_routing(model, batch, need_entropy):  # noqa: ANN001, ANN202
        out = plain(model, batch, need_entropy)
        if "routed_experts" not in batch:  # recording: one expert id per token, closed form
            out["routed_experts"] = (batch["input_ids"] % 4)[..., None, None].expand(-1, -1, 2, 1).clone()
        return out

    monkeypatch.setattr(fakes_module, "fake_outputs", with_routing)
    trainer, _ = build(tmp_path, AlgorithmConfig(name="grpo"), free_memory=False, reuse=False)
    fakes.clear()
    trainer.step(1)
    old, update = fakes.of("actor", "forward_backward")
    assert "routed_experts" not in old.keys
    assert update.keys == SCORED_KEYS | {"old_log_probs", "routed_experts"} | ADVANTAGE_KEYS


def test_one_optimizer_step_reuses_the_updates_forward(tmp_path: Path, fakes: FakeBackends) -> None:
    trainer, log = build(tmp_path, AlgorithmConfig(name="grpo"), free_memory=False)
    fakes.clear()
    metrics = trainer.step(1)
    # no separate old-log-prob forward: the update's forward (with entropy) supplies them
    assert [(c.role, c.hook) for c in fakes.calls] == [
        ("actor", "reshard_for_rollout"),
        ("rollout", "update_weights"),
        ("rollout", "generate"),
        ("actor", "forward_backward"),
        ("actor", "optimizer_step"),
    ]
    assert [(g.role, g.method, g.dispatch) for g in log] == [
        ("actor", "generate", Dispatch.DP),
        ("reward", "score", Dispatch.DP),
        ("actor", "update_once", Dispatch.DP),
    ]
    (update,) = fakes.of("actor", "forward_backward")
    assert update.keys == SCORED_KEYS | ADVANTAGE_KEYS and update.detail == {
        "forward_only": False,
        "loss": True,
        "need_entropy": True,
    }
    # the same numbers as with the separate forward (test above): they come from the update's own
    assert metrics["actor/entropy"] == 1.0
    assert metrics["rollout_mismatch/mean_abs_diff"] == pytest.approx(0.0225, abs=1e-6)
    assert metrics["actor/pg_loss"] == pytest.approx(-1 / 3, abs=1e-6)
    assert metrics["actor/grad_norm"] == pytest.approx(1 / 3, abs=1e-6)


def test_ppo_hybrid_switch_reference_and_critic(tmp_path: Path, fakes: FakeBackends) -> None:
    algorithm = AlgorithmConfig(name="ppo", use_kl_loss=True, critic_warmup_steps=1)
    trainer, log = build(tmp_path, algorithm, free_memory=True)
    assert sorted({c.role for c in fakes.calls}) == ["actor", "critic", "reference", "rollout"]
    assert [c.detail for c in fakes.of("critic", "build_model")] == [{"value_head": True}]
    fakes.clear()
    trainer.step(1)

    assert [(c.role, c.hook) for c in fakes.calls] == [
        ("actor", "reshard_for_rollout"),
        ("rollout", "update_weights"),
        ("actor", "offload"),  # the hybrid switch: training memory out while generating...
        ("rollout", "generate"),
        ("rollout", "release"),  # ...and the rollout's out while training
        ("actor", "onload"),
        ("actor", "forward_backward"),
        ("reference", "forward_backward"),
        ("critic", "forward_backward"),
        ("critic", "forward_backward"),
        ("critic", "optimizer_step"),  # critic warm-up: the actor does not train in step 1
    ]
    assert [(g.role, g.method, g.dispatch) for g in log] == [
        ("actor", "generate", Dispatch.DP),
        ("reward", "score", Dispatch.DP),
        ("actor", "compute_log_probs", Dispatch.DP),
        ("reference", "compute_log_probs", Dispatch.DP),
        ("critic", "compute_values", Dispatch.DP),
        ("critic", "update", Dispatch.DP),
    ]
    _, ref, values, critic_update = [c for c in fakes.calls if c.hook == "forward_backward"]
    assert ref.keys == SCORED_KEYS | {"old_log_probs"} and ref.detail["forward_only"]
    assert values.keys == SCORED_KEYS | {"old_log_probs", "ref_log_probs"} and values.detail["forward_only"]
    assert critic_update.keys == SCORED_KEYS | {"old_log_probs", "ref_log_probs", "old_values"} | ADVANTAGE_KEYS
    # GAE with gamma = lam = 1: returns = the sequence's reward at every response token
    mask = critic_update.batch["response_mask"].bool()
    for row, length in enumerate(by_hand_lengths()):
        torch.testing.assert_close(
            critic_update.batch["returns"][row][mask[row]], torch.full((length,), float(length)), atol=1e-5, rtol=0
        )

    # step 2: the actor did not change, so no weight sync; the rollout resumes first
    fakes.clear()
    log.clear()
    trainer.step(2)
    assert fakes.hooks()[:5] == ["resume", "offload", "generate", "release", "onload"]
    assert [(c.role, c.hook) for c in fakes.calls][-4:] == [
        ("critic", "forward_backward"),
        ("critic", "optimizer_step"),
        ("actor", "forward_backward"),
        ("actor", "optimizer_step"),
    ]
    # one optimizer step for the actor: no separate old-log-prob forward, the update's own
    assert [(g.role, g.method) for g in log][-2:] == [("critic", "update"), ("actor", "update_once")]
    assert ("actor", "compute_log_probs") not in [(g.role, g.method) for g in log]
    actor_update = fakes.of("actor", "forward_backward")[-1]
    assert actor_update.keys == SCORED_KEYS | {"ref_log_probs", "old_values"} | ADVANTAGE_KEYS

    # step 3: the actor changed in step 2, so its weights are synced after the resume
    fakes.clear()
    trainer.step(3)
    assert fakes.hooks()[:4] == ["resume", "reshard_for_rollout", "update_weights", "offload"]
