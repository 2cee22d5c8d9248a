"""vLLM rollouts colocated with 2 FSDP ranks on Ray: each rank syncs its gathered weights
into its own vLLM engine and generates its share; the trainer's log-probs of every sample
agree with the vLLM engine that sampled it, on both ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from geartrain.trainer.config import load_train_config
from geartrain.trainer.run import run_job
from ray_helpers import MAIN_CONFIG, RAY2, SHORT, digit_reward, record_rollout_gaps, records

pytest.importorskip("geartrain_vllm")
pytestmark = [pytest.mark.slow]

STEPS = 3


def test_vllm_rollout_on_two_ray_ranks_matches_the_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, per_rank = record_rollout_gaps(monkeypatch)
    out = tmp_path / "run"
    config = load_train_config(
        MAIN_CONFIG,
        [
            *SHORT,
            *RAY2,
            "rollout.backend=vllm",
            f"trainer.total_steps={STEPS}",
            "trainer.save_every=0",
            f"trainer.output_dir={out}",
        ],
    )
    run_job(config, reward_fn=digit_reward)
    recs = records(out / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(STEPS + 1))
    assert len(per_rank[0]) == len(per_rank[1]) == STEPS, per_rank  # both replicas sampled every step
    assert max(per_rank[0] + per_rank[1]) < 1e-3, per_rank
    assert any(r["actor/grad_norm"] > 0 for r in recs[1:])  # the weights moved, so every sync mattered
