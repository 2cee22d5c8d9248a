"""``rollout.placement = "separate"`` with vLLM replicas: 1 FSDP trainer rank + 2 replicas,
each a Ray actor holding a whole vLLM engine, ``max_staleness = 0``.

* After every broadcast each replica samples with the trainer's weights: the trainer's
  log-probs of the tokens each replica sampled equal the replica's (fp32; the tolerance of
  the colocated vLLM test, tests/ray/test_ray_vllm.py), on both replicas, every step.
* The run reproduces the colocated vLLM run (1 Ray rank, the same seeds): the same sampled
  responses and the same rewards, losses and gradient norms.

(SGLang replicas: tests/ray/test_separate_sglang.py, run in the SGLang environment.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ray_helpers import gap_recorded_run

pytest.importorskip("geartrain_vllm")
pytestmark = [pytest.mark.slow]

STEPS = 3
KEYS = ("reward/mean", "reward/std", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac")
SEPARATE = ["rollout.placement=separate", "rollout.replicas=2", "rollout.resources_per_replica={cpus=0.5}"]


def test_separate_vllm_replicas_sample_with_the_trainers_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    separate, separate_texts, gaps = gap_recorded_run(tmp_path / "separate", monkeypatch, "vllm", STEPS, *SEPARATE)
    assert [r["step"] for r in separate] == list(range(STEPS + 1))
    assert sorted(gaps) == [0, 1] and all(len(g) == STEPS for g in gaps.values()), gaps  # both replicas, every step
    assert max(max(g) for g in gaps.values()) < 1e-3, gaps
    assert any(r["actor/grad_norm"] > 0 for r in separate[1:])  # the weights moved: every broadcast mattered
    assert all(r["async/staleness_max"] == 0.0 for r in separate[1:])

    colocated, colocated_texts, _ = gap_recorded_run(tmp_path / "colocated", monkeypatch, "vllm", STEPS)
    assert separate_texts == colocated_texts, "the vLLM replicas sampled other tokens than the colocated vLLM rollout"
    for a, b in zip(colocated[1:], separate[1:], strict=True):
        for key in KEYS:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
