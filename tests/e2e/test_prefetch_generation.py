"""``trainer.prefetch_generation``: the next step's generation sent behind the actor's update
trains bit for bit like the synchronous run (same samples from the same weights, validation
and checkpoints in between), and a checkpoint taken while a generation is sent ahead
records the loader's position before that generation's prompts.

The Ray placement is where the prefetch pays (its ``submit`` returns before the ranks ran
the call); here the inline group is told it overlaps, so it takes the same path: its
``submit`` runs each call at once, in the order sent, as a Ray rank runs them."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import MAIN_CONFIG
from geartrain.cluster import InlineWorkerGroup
from geartrain.trainer import load_train_config, run_job
from geartrain.trainer.metrics import read_jsonl
from geartrain.trainer.rl import RLTrainer

pytestmark = pytest.mark.e2e

STEPS = 4
SMALL = [
    "sft.enabled=false",
    f"trainer.total_steps={STEPS}",
    "trainer.save_every=2",
    "validation.every_n_steps=2",
    "validation.max_prompts=8",
    "data.batch_size=4",
    "sampling.n=4",
    "trainer.tensorboard=false",
    "trainer.export_hf=false",
    "trainer.plot=false",
    "trainer.progress=false",
]
UNSTABLE = ("timing/", "perf/", "hybrid/")


def _run(out: Path, reward: Path, prefetch: bool, extra: list[str]) -> list[dict[str, Any]]:
    overrides = [
        *SMALL,
        *extra,
        f"reward.function={reward}:score",
        f"trainer.prefetch_generation={str(prefetch).lower()}",
        f"trainer.output_dir={out}",
    ]
    run_job(load_train_config(MAIN_CONFIG, overrides))
    return [
        {k: v for k, v in r.items() if not k.startswith(UNSTABLE)}
        for r in read_jsonl(out / "metrics.jsonl")
        if r["phase"] == "rl"
    ]


# one optimizer step reusing its forward's log-probs (update_once), and two mini-batches
# after a separate old-log-prob forward (update)
@pytest.mark.parametrize("extra", [[], ["algorithm.mini_batches=2"]], ids=["update_once", "update"])
def test_prefetched_generation_trains_exactly_like_the_synchronous_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str]
) -> None:
    # an untrained model never answers right: reward the length, so the policy changes every step
    reward = tmp_path / "length_reward.py"
    reward.write_text("def score(response, ground_truth):\n    return float(len(response))\n")
    saved_states: list[dict[str, Any]] = []
    loader_state = RLTrainer.loader_state

    def recording_loader_state(self: RLTrainer) -> dict[str, Any]:
        saved_states.append(copy.deepcopy(loader_state(self)))
        return saved_states[-1]

    monkeypatch.setattr(RLTrainer, "loader_state", recording_loader_state)
    plain = _run(tmp_path / "plain", reward, prefetch=False, extra=extra)
    plain_states, saved_states[:] = list(saved_states), []

    sent: list[str] = []
    submit = InlineWorkerGroup.submit

    def recording_submit(self: InlineWorkerGroup, method: str, *args: Any, **kwargs: Any) -> Any:
        sent.append(method)
        return submit(self, method, *args, **kwargs)

    monkeypatch.setattr(InlineWorkerGroup, "overlaps", True)
    monkeypatch.setattr(InlineWorkerGroup, "submit", recording_submit)
    ahead = _run(tmp_path / "ahead", reward, prefetch=True, extra=extra)

    assert sent.count("generate") == STEPS - 1, sent  # steps 2..4 were generated ahead, not step 5
    assert all(r["actor/grad_norm"] > 0 for r in plain[1:]), "the policy must change every step"
    assert [r["step"] for r in plain] == list(range(STEPS + 1))
    assert ahead == plain  # every metric of every step (validations included), bit for bit
    # the checkpoints at steps 0, 2 and 4 (step 3's prompts were drawn when step 2 saved)
    assert len(plain_states) == 3 and saved_states == plain_states
