"""Multi-turn episodes on Ray (the calculator job, ``[rollout.agent]``): the same episodes,
token for token, inline and on two Ray ranks (each rank's rollout runs its share of the
episodes); and with vLLM rollouts on two Ray ranks, the trainer's log-probs of every
episode's model tokens agree with the engine that sampled them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import geartrain.trainer.rl as rl
import pytest
from geartrain.batch import Batch
from geartrain.trainer.config import load_train_config
from geartrain.trainer.run import run_job
from ray_helpers import RAY2, ROOT, digit_reward, record_rollout_gaps, records

pytestmark = [pytest.mark.slow]

AGENT_CONFIG = ROOT / "examples" / "calculator" / "grpo.toml"
STEPS = 3
#: GRPO episodes from the random tiny model: no warm start, no validation, nothing optional.
SHORT = [
    "sft.enabled=false",
    "validation.path=null",
    "trainer.tensorboard=false",
    "trainer.plot=false",
    "trainer.export_hf=false",
    "trainer.progress=false",
    "data.batch_size=4",
    "sampling.n=4",
    f"trainer.total_steps={STEPS}",
    "trainer.save_every=0",
    # three turns per episode whatever the untrained model writes
    f"rollout.agent.environment={Path(__file__).with_name('agent_envs.py')}:ThreeTurns",
    "rollout.agent.max_turns=3",
]


def _episodes(batch: Batch) -> list[tuple[list[int], list[int]]]:
    """Each row's real tokens and which of them the model sampled."""
    ids, attention, mask = batch["input_ids"], batch["attention_mask"].bool(), batch["response_mask"]
    return [(ids[r][attention[r]].tolist(), mask[r][attention[r]].tolist()) for r in range(len(batch))]


def _run(out: Path, monkeypatch: pytest.MonkeyPatch, *extra: str) -> tuple[list[dict], list[Batch]]:
    seen: list[Batch] = []
    original = rl.RLTrainer._score

    def score(self: rl.RLTrainer, batch: Batch) -> object:
        seen.append(batch)
        return original(self, batch)

    monkeypatch.setattr(rl.RLTrainer, "_score", score)
    config = load_train_config(AGENT_CONFIG, [*SHORT, f"trainer.output_dir={out}", *extra])
    run_job(config, reward_fn=digit_reward)
    monkeypatch.setattr(rl.RLTrainer, "_score", original)
    return records(out / "metrics.jsonl"), seen


def test_episodes_on_two_ray_ranks_match_inline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inline, inline_batches = _run(tmp_path / "inline", monkeypatch)
    ray2, ray_batches = _run(tmp_path / "ray", monkeypatch, *RAY2)
    assert len(inline_batches) == len(ray_batches) == STEPS
    assert any(r["actor/grad_norm"] > 0 for r in inline[1:]), "no gradient: later steps would not test the syncs"
    for step, (a, b) in enumerate(zip(inline_batches, ray_batches, strict=True)):
        assert _episodes(a) == _episodes(b), f"step {step}: the two placements ran different episodes"
        turns = [e["model_turns"] for e in a["episode"]]
        assert turns == [3] * len(turns), f"step {step}: episodes of {turns} turns"
        assert sorted(set(b["rollout_rank"])) == [0, 1], "both Ray ranks must run episodes"


@pytest.mark.skipif(importlib.util.find_spec("geartrain_vllm") is None, reason="needs the vLLM rollout plugin")
def test_vllm_episodes_on_two_ray_ranks_match_the_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    batches, per_rank = record_rollout_gaps(monkeypatch)
    out = tmp_path / "run"
    config = load_train_config(AGENT_CONFIG, [*SHORT, *RAY2, "rollout.backend=vllm", f"trainer.output_dir={out}"])
    run_job(config, reward_fn=digit_reward)
    recs = records(out / "metrics.jsonl")
    assert len(per_rank[0]) == len(per_rank[1]) == STEPS, per_rank
    assert max(per_rank[0] + per_rank[1]) < 1e-3, per_rank
    assert all(e["model_turns"] == 3 for b in batches for e in b["episode"]), "every episode has three turns"
    assert any(r["actor/grad_norm"] > 0 for r in recs[1:])
