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
from ray_helpers import gap_recorded_run

pytest.importorskip("geartrain_sglang")
pytest.importorskip("sglang")
pytestmark = [pytest.mark.slow]

STEPS = 3
KEYS = ("reward/mean", "reward/std", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac")
SEPARATE = ["rollout.placement=separate", "rollout.replicas=1", "rollout.resources_per_replica={cpus=0.5}"]


def test_separate_sglang_replica_samples_with_the_trainers_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    separate, separate_texts, gaps = gap_recorded_run(tmp_path / "separate", monkeypatch, "sglang", STEPS, *SEPARATE)
    print(f"max |trainer - SGLang replica| log-prob per step: {gaps[0]}")
    assert [r["step"] for r in separate] == list(range(STEPS + 1))
    assert sorted(gaps) == [0] and len(gaps[0]) == STEPS, gaps  # the replica, every step
    assert max(gaps[0]) < 1e-3, gaps
    assert any(r["actor/grad_norm"] > 0 for r in separate[1:])  # the weights moved: every broadcast mattered
    assert all(r["async/staleness_max"] == 0.0 for r in separate[1:])

    colocated, colocated_texts, _ = gap_recorded_run(tmp_path / "colocated", monkeypatch, "sglang", STEPS)
    assert separate_texts == colocated_texts, "the SGLang replica sampled other tokens than the colocated rollout"
    for a, b in zip(colocated[1:], separate[1:], strict=True):
        for key in KEYS:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
