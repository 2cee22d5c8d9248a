"""A run that writes checkpoints trains exactly like one that does not (the job saves before
step 1, when the optimizer has not stepped yet: that save must leave it untouched)."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_helpers import MAIN_CONFIG
from geartrain.trainer import load_train_config, run_job
from geartrain.trainer.metrics import read_jsonl

pytestmark = pytest.mark.e2e

SMALL = [
    "sft.enabled=false",
    "trainer.total_steps=3",
    "data.batch_size=4",
    "sampling.n=4",
    "validation.every_n_steps=0",
    "validation.max_prompts=8",
    "trainer.tensorboard=false",
    "trainer.export_hf=false",
    "trainer.plot=false",
    "trainer.progress=false",
]
#: measurements of time and memory, which differ between any two runs
UNSTABLE = ("timing/", "perf/", "hybrid/")


def _run(out: Path, save_every: int, reward: Path) -> list[dict]:
    overrides = [
        *SMALL,
        f"reward.function={reward}:score",
        f"trainer.save_every={save_every}",
        f"trainer.output_dir={out}",
    ]
    run_job(load_train_config(MAIN_CONFIG, overrides))
    return [
        {k: v for k, v in r.items() if not k.startswith(UNSTABLE)}
        for r in read_jsonl(out / "metrics.jsonl")
        if r["phase"] == "rl"
    ]


def test_saving_every_step_gives_bitwise_the_same_run(tmp_path: Path) -> None:
    # an untrained model never answers right: reward the length, so advantages (and the
    # updates a changed optimizer state would alter) are not all zero
    reward = tmp_path / "length_reward.py"
    reward.write_text("def score(response, ground_truth):\n    return float(len(response))\n")
    plain = _run(tmp_path / "plain", 0, reward)
    saved = _run(tmp_path / "saved", 1, reward)
    assert (tmp_path / "saved" / "checkpoints" / "actor").exists()
    assert [r["step"] for r in plain] == [0, 1, 2, 3]
    assert all(r["actor/grad_norm"] > 0 for r in plain[1:]), "the policy must actually train"
    assert saved == plain  # every metric of every step, bit for bit
