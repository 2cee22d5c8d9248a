"""``rollout.placement = "separate"`` with an SGLang replica: 1 FSDP trainer rank + 1 replica,
a Ray actor holding a whole ``sglang.Engine`` (CPU recipe), ``max_staleness = 0``.

* After every broadcast the replica samples with the trainer's weights: the trainer's
  log-probs of the tokens it sampled equal SGLang's (fp32; the tolerance of the vLLM replica
  test, tests/ray/test_separate_vllm.py), every step.
* The run reproduces the colocated SGLang run (1 Ray rank, the same seeds): the same sampled
  responses and the same rewards, losses and gradient norms.

Runs in .venvs/sglang with the FSDP engine and Ray added (make test-sglang-e2e); the main
environment of the other Ray tests has no SGLang, so there it is skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from geartrain.trainer.config import load_train_config
from geartrain.trainer.run import run_job
from ray_helpers import MAIN_CONFIG, SHORT, digit_reward, record_rollout_gaps, records

pytest.importorskip("geartrain_sglang")
pytest.importorskip("sglang")
pytestmark = [pytest.mark.slow]

STEPS = 3
KEYS = ("reward/mean", "reward/std", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac")
SEPARATE = ["rollout.placement=separate", "rollout.replicas=1", "rollout.resources_per_replica={cpus=0.5}"]


def _run(
    out: Path, monkeypatch: pytest.MonkeyPatch, *extra: str
) -> tuple[list[dict], list[list[str]], dict[int, list[float]]]:
    """The job's metric records, per step the responses it scored, and per replica (rank
    that sampled the rows) each step's largest |trainer - rollout| log-prob gap."""
    batches, gaps = record_rollout_gaps(monkeypatch)
    config = load_train_config(
        MAIN_CONFIG,
        [
            *SHORT,
            "cluster.placement=ray",
            "rollout.backend=sglang",
            f"trainer.total_steps={STEPS}",
            "trainer.save_every=0",
            f"trainer.output_dir={out}",
            *extra,
        ],
    )
    try:
        run_job(config, reward_fn=digit_reward)
    finally:
        monkeypatch.undo()
    return records(out / "metrics.jsonl"), [list(b["response_text"]) for b in batches], gaps


def test_separate_sglang_replica_samples_with_the_trainers_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    separate, separate_texts, gaps = _run(tmp_path / "separate", monkeypatch, *SEPARATE)
    print(f"max |trainer - SGLang replica| log-prob per step: {gaps[0]}")
    assert [r["step"] for r in separate] == list(range(STEPS + 1))
    assert sorted(gaps) == [0] and len(gaps[0]) == STEPS, gaps  # the replica, every step
    assert max(gaps[0]) < 1e-3, gaps
    assert any(r["actor/grad_norm"] > 0 for r in separate[1:])  # the weights moved: every broadcast mattered
    assert all(r["async/staleness_max"] == 0.0 for r in separate[1:])

    colocated, colocated_texts, _ = _run(tmp_path / "colocated", monkeypatch)
    assert separate_texts == colocated_texts, "the SGLang replica sampled other tokens than the colocated rollout"
    for a, b in zip(colocated[1:], separate[1:], strict=True):
        for key in KEYS:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
