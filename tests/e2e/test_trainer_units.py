"""Fast checks of the trainer's pieces: the JSONL writer's resume truncation, the SFT
batch layout, reward-file resolution, seeds per step and the worker-group boundary."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from geartrain.cluster import Dispatch, InlineWorkerGroup, create_worker_group
from geartrain.data import PromptRow
from geartrain.errors import ConfigError, GeartrainError
from geartrain.testing import tiny_tokenizer
from geartrain.trainer.config import TrainConfig, load_train_config
from geartrain.trainer.metrics import JsonlLogger, plot_curves, read_jsonl
from geartrain.trainer.preflight import resolve_reward
from geartrain.trainer.rl import step_seed
from geartrain.trainer.run import _due
from geartrain.trainer.sft import sft_batch


def test_jsonl_resume_drops_rl_records_after_the_checkpoint_and_a_cut_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = JsonlLogger(path)
    for step in (1, 2):
        log.write({"phase": "sft", "step": step, "sft/loss": 1.0 / step})
    for step in range(0, 6):
        log.write({"phase": "rl", "step": step, "reward/mean": step / 10})
    log.close()
    with path.open("a") as f:
        f.write('{"phase": "rl", "step": 6, "rew')  # cut off by a kill
    log = JsonlLogger(path, resume_step=3)
    log.write({"phase": "rl", "step": 4, "reward/mean": 0.0})
    log.close()
    records = read_jsonl(path)
    assert [(r["phase"], r["step"]) for r in records] == [
        ("sft", 1),
        ("sft", 2),
        ("rl", 0),
        ("rl", 1),
        ("rl", 2),
        ("rl", 3),
        ("rl", 4),
    ]
    assert records[-1]["reward/mean"] == 0.0


def test_jsonl_fresh_run_starts_empty_and_writes_nan_as_null(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"phase": "rl", "step": 9}\n')
    log = JsonlLogger(path)
    log.write({"phase": "rl", "step": 0, "x": float("nan")})
    log.close()
    assert read_jsonl(path) == [{"phase": "rl", "step": 0, "x": None}]


def test_sft_batch_layout_left_pads_prompts_and_masks_response_plus_eos() -> None:
    tok = tiny_tokenizer()
    rows = [
        PromptRow(
            prompt_ids=tok("1+2=", add_special_tokens=False)["input_ids"],
            prompt="1+2=",
            ground_truth="3",
            meta={"response": "3"},
        ),
        PromptRow(
            prompt_ids=tok("10+20=", add_special_tokens=False)["input_ids"],
            prompt="10+20=",
            ground_truth="30",
            meta={"response": "30"},
        ),
    ]
    batch = sft_batch(rows, tok, "response")
    assert batch.info["prompt_length"] == 6
    ids, att, loss = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    assert tok.decode(ids[0][att[0].bool()].tolist()) == "1+2=3</s>"
    assert tok.decode(ids[1][att[1].bool()].tolist()) == "10+20=30</s>"
    assert att[0].tolist() == [0, 0, 1, 1, 1, 1, 1, 1, 0]
    assert loss[0].tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 0]
    assert loss[1].tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert int(ids[0, 7]) == tok.eos_token_id


def test_resolve_reward_imports_a_file_relative_to_the_job(tmp_path: Path) -> None:
    (tmp_path / "r.py").write_text("def score(response, ground_truth):\n    return 7.0\n")
    fn = resolve_reward("r.py:score", str(tmp_path))
    assert fn("a", "b") == 7.0
    assert resolve_reward("arithmetic", None) == "arithmetic"
    with pytest.raises(GeartrainError, match="does not exist"):
        resolve_reward("missing.py:score", str(tmp_path))
    with pytest.raises(GeartrainError, match="no function 'nope'"):
        resolve_reward("r.py:nope", str(tmp_path))


def test_due_and_step_seeds() -> None:
    assert [s for s in range(1, 11) if _due(s, 4, 10)] == [4, 8, 10]
    assert [s for s in range(1, 4) if _due(s, 0, 3)] == [3]
    assert step_seed(0, 5) == step_seed(0, 5) != step_seed(0, 6) != step_seed(1, 5)


class _Echo:
    def __init__(self, scale: int, *, ctx) -> None:  # noqa: ANN001
        self.scale, self.ctx = scale, ctx

    def times(self, x: int) -> int:
        return x * self.scale


def test_inline_worker_group_builds_one_rank_in_process_and_checks_dispatch() -> None:
    group = create_worker_group("inline", "actor", _Echo, 3, seed=5)
    assert isinstance(group, InlineWorkerGroup) and group.world_size == 1
    assert group.worker.ctx.role == "actor" and group.worker.ctx.seed == 5 and group.worker.ctx.rank == 0
    assert group.call("times", 4) == 12
    with pytest.raises(TypeError, match="Dispatch.DP needs a Batch"):
        group.call("times", 4, dispatch=Dispatch.DP)
    with pytest.raises(ConfigError, match="cluster.placement"):
        create_worker_group("ray", "actor", _Echo, 3)


def test_config_defaults_and_paths(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('[model]\ntiny = "qwen2"\n[data]\npath = "d/train.jsonl"\n[algorithm]\nname = "ppo"\n')
    config = load_train_config(job, ["trainer.total_steps=3"])
    assert config.algorithm.estimator == "gae" and not config.algorithm.needs_reference
    assert config.resolve(config.data.path) == str(tmp_path / "d" / "train.jsonl")
    assert config.resolve("~/x") == str(Path("~/x").expanduser())
    assert TrainConfig().algorithm.estimator == "grpo"
    with pytest.raises(ConfigError, match="reward"):
        load_train_config(job, ["reward.function=''"])


def test_plot_curves_writes_a_png(tmp_path: Path) -> None:
    records = [{"phase": "sft", "step": i, "sft/loss": 1 / i} for i in range(1, 5)]
    records += [
        {"phase": "rl", "step": i, "reward/mean": i / 10, "val/accuracy": i / 20, "timing/generate_s": 0.1}
        for i in range(5)
    ]
    png = plot_curves(records, tmp_path / "c.png", title="t").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # one panel per curve present: SFT loss, reward, validation accuracy, seconds per phase
    # -> 2 rows of 3 panels, 4.5 x 3.2 inches each at 90 dpi (the PNG header's width/height)
    assert struct.unpack(">II", png[16:24]) == (int(3 * 4.5 * 90), int(2 * 3.2 * 90))
    one = plot_curves([r for r in records if "reward/mean" in r], tmp_path / "one.png").read_bytes()
    assert struct.unpack(">II", one[16:24]) == (int(3 * 4.5 * 90), int(1 * 3.2 * 90))
