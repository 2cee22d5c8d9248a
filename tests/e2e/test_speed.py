"""The trainer's speed shortcuts leave training unchanged: skipping the separate old-log-prob
forward when a batch gets one optimizer step gives bitwise the same parameters."""

from __future__ import annotations

from pathlib import Path

import torch

from e2e_helpers import MAIN_CONFIG
from geartrain.modeling import load_tokenizer
from geartrain.trainer.config import load_train_config
from geartrain.trainer.rl import RLTrainer
from geartrain.trainer.run import Job

#: the main job's GRPO phase from its tiny model (no SFT): short, but every piece runs
SHORT = ["sft.enabled=false", "trainer.tensorboard=false", "trainer.export_hf=false", "trainer.plot=false"]


def _train(tmp: Path, reuse: bool, steps: int, extra: list[str] = ()) -> tuple[dict[str, torch.Tensor], list[dict], int]:
    overrides = [*SHORT, f"trainer.output_dir={tmp}", f"trainer.reuse_update_log_probs={str(reuse).lower()}", *extra]
    cfg = load_train_config(MAIN_CONFIG, overrides)
    torch.manual_seed(cfg.trainer.seed)
    job = Job(cfg)
    tokenizer = load_tokenizer(cfg.model)
    loader, _ = job._data(tokenizer)
    roles = job._roles(cfg.model)
    worker = roles.actor.worker
    calls = {"compute_log_probs": 0}
    real = worker.compute_log_probs

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls["compute_log_probs"] += 1
        return real(*args, **kwargs)

    worker.compute_log_probs = counted
    trainer = RLTrainer(cfg, roles, tokenizer, loader)
    records = [trainer.step(step) for step in range(1, steps + 1)]
    params = {k: v.detach().clone() for k, v in worker.engine.handle.hf.state_dict().items()}
    roles.actor.shutdown()
    return params, records, calls["compute_log_probs"]


def _length_reward(tmp: Path) -> str:
    """The untrained tiny model never answers right; reward response length instead, so
    advantages are non-zero and every step moves the weights."""
    (tmp / "length.py").write_text("def score(response, ground_truth):\n    return float(len(response))\n")
    return f"reward.function={tmp / 'length.py'}:score"


def test_reusing_the_update_log_probs_trains_bitwise_identically(tmp_path: Path) -> None:
    steps = 4
    reward = _length_reward(tmp_path)
    initial, _, _ = _train(tmp_path / "init", reuse=True, steps=0, extra=[reward])
    with_forward, rec_a, calls_a = _train(tmp_path / "a", reuse=False, steps=steps, extra=[reward])
    shortcut, rec_b, calls_b = _train(tmp_path / "b", reuse=True, steps=steps, extra=[reward])
    assert calls_a == steps and calls_b == 0  # the shortcut really skipped the forward
    assert with_forward.keys() == shortcut.keys()
    for name, value in with_forward.items():
        assert torch.equal(value, shortcut[name]), f"{name}: max diff {(value - shortcut[name]).abs().max()}"
    # the metrics the separate forward gave come from the update's forward, unchanged
    for a, b in zip(rec_a, rec_b, strict=True):
        for key in ("actor/entropy", "rollout_mismatch/mean_abs_diff", "actor/pg_loss", "actor/grad_norm", "reward/mean"):
            assert a[key] == b[key], (key, a[key], b[key])
    # training moved the weights (an untrained comparison would prove nothing)
    assert all(r["actor/grad_norm"] > 0 for r in rec_b)
    assert not all(torch.equal(initial[k], shortcut[k]) for k in initial)
