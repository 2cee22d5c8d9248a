"""Issue 35, item 9: every float the schema accepts is finite and bounded, so a value a run
cannot use is refused in one line by its key instead of failing steps later (an
OverflowError in a reward timeout, a NaN loss blamed on the learning rate, training on
uniform noise at an infinite temperature); an absurd group size gets a note."""

from __future__ import annotations

from pathlib import Path

import pytest
from geartrain.cli import main
from geartrain.errors import ConfigError
from geartrain.trainer import load_train_config

JOB = Path(__file__).resolve().parents[2] / "examples" / "arithmetic" / "grpo.toml"


@pytest.mark.parametrize(
    ("override", "key", "says"),
    [
        ("reward.timeout_s=1e300", "reward.timeout_s", "less than or equal to 10000000"),
        ("algorithm.entropy_coef=nan", "algorithm.entropy_coef", "finite number"),
        ("algorithm.entropy_coef=1e300", "algorithm.entropy_coef", "less than or equal to 1000000"),
        ("sampling.temperature=inf", "sampling.temperature", "finite number"),
        ("sampling.temperature=1e9", "sampling.temperature", "less than or equal to 100"),
        ("cluster.call_timeout_s.step=1e300", "cluster.call_timeout_s.step", "less than or equal to 10000000"),
        ("cluster.startup_timeout_s=inf", "cluster.startup_timeout_s", "finite number"),
        ("actor.engine.optim.lr=nan", "actor.engine.optim.lr", "finite number"),
        # probes3: torch.set_num_threads(100000) segfaulted the driver (exit 139) after
        # --overwrite had set the previous run aside, and load went to 97
        ("trainer.torch_threads=100000", "trainer.torch_threads", "less than or equal to 1024"),
    ],
)
def test_a_value_the_run_cannot_use_is_refused_by_its_key(override: str, key: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_train_config(JOB, [override], check_plugins=False)
    text = str(info.value)
    assert f"{key}: should be" in text and says in text, text


@pytest.mark.parametrize("weight", ["nan", "inf", "-inf", "1e300"])
def test_a_reward_weight_must_be_finite_and_bounded(tmp_path: Path, weight: str) -> None:
    job = tmp_path / "job.toml"
    job.write_text(
        JOB.read_text()
        .replace('function = "task.py:exact_match"', "")
        .replace("[reward]", "[reward]\nfunctions = [{ name = 'a', function = 'arithmetic', weight = " + weight + " }]")
    )
    with pytest.raises(ConfigError) as info:
        load_train_config(job, [], check_plugins=False)
    assert "reward.functions[0].weight: should be" in str(info.value), str(info.value)


def test_an_agent_step_timeout_is_bounded() -> None:
    overrides = ['rollout.agent.environment="tools"', "rollout.agent.step_timeout_s=1e300"]
    with pytest.raises(ConfigError) as info:
        load_train_config(JOB, overrides, check_plugins=False)
    assert "rollout.agent.step_timeout_s: should be less than or equal to 10000000" in str(info.value)


def test_a_huge_group_gets_a_note(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # its own output_dir: the example's outputs/arithmetic_grpo holds a run once `make train` ran
    assert main(["check", str(JOB), "sampling.n=1e6", "--no-plugins", f"trainer.output_dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    assert "note: sampling.n=1000000 samples per prompt: each step generates and scores" in out, out


def test_a_weight_decay_that_flips_the_weights_is_refused() -> None:
    """Rerun on another key: ``weight_decay=1e300`` was accepted, then stopped the run at
    step 2 blaming the learning rate (AdamW multiplies the weights by 1 - lr x weight_decay)."""
    with pytest.raises(ConfigError) as info:
        load_train_config(JOB, ["actor.engine.optim.weight_decay=1e300"], check_plugins=False)
    assert "actor.engine.optim: weight_decay=1e+300 with lr=0.0003" in str(info.value), str(info.value)
    assert "lr x weight_decay must be below 1" in str(info.value)
    load_train_config(JOB, ["actor.engine.optim.weight_decay=0.1"], check_plugins=False)


@pytest.mark.parametrize("key", ["trainer.seed", "model.seed", "data.seed", "sft.seed"])
@pytest.mark.parametrize(
    ("value", "says"), [(2**70, "less than or equal to 9223372036854775807"), (-1, "greater than")]
)
def test_a_seed_the_generators_cannot_take_is_refused(key: str, value: int, says: str) -> None:
    """Probe rerun for issue 35 item 9: ``trainer.seed=2**70`` passed ``check`` and the run
    died in ``torch.manual_seed`` ("Overflow when unpacking long long", 35 lines, exit 1);
    ``trainer.seed=-1`` in numpy's seed sequence at step 1 (46 lines)."""
    with pytest.raises(ConfigError) as info:
        load_train_config(JOB, [f"{key}={value}"], check_plugins=False)
    assert f"{key}: should be {says}" in str(info.value), str(info.value)


def test_the_largest_seed_is_one_every_generator_takes() -> None:
    """The bound is the generators' own: the run's seeding, a torch generator and numpy's
    seed sequence (the data order) all take :data:`MAX_SEED`."""
    import numpy as np
    import torch
    from geartrain.limits import MAX_SEED
    from geartrain.trainer.run import _seed_everything

    config = load_train_config(JOB, [f"trainer.seed={MAX_SEED}", f"data.seed={MAX_SEED}"], check_plugins=False)
    assert config.trainer.seed == config.data.seed == MAX_SEED == 2**63 - 1
    _seed_everything(MAX_SEED)
    first = torch.Generator().manual_seed(MAX_SEED).initial_seed()
    assert first == MAX_SEED
    order = np.random.default_rng([MAX_SEED, 0]).permutation(5).tolist()
    assert sorted(order) == [0, 1, 2, 3, 4]


def test_more_mini_batches_than_samples_is_refused() -> None:
    """Probe rerun for issue 35 item 9 (probes3): ``algorithm.mini_batches=64`` with 4 prompts x
    2 samples trained: 56 of the 64 optimizer steps had no sample, yet advanced the learning
    rate schedule (its warm-up spent on nothing), and the step's actor metrics were averaged
    over them (ratio_mean 0.125, sequences 0.125). Each optimizer step needs a sample."""
    base = ["data.batch_size=4", "sampling.n=2", "sft.enabled=false"]
    with pytest.raises(ConfigError) as info:
        load_train_config(JOB, [*base, "algorithm.mini_batches=9"], check_plugins=False)
    assert (
        "algorithm.mini_batches (9) exceeds the samples of a step, data.batch_size (4) x sampling.n (2) = 8: "
        "each mini-batch is one optimizer step and needs a sample; lower algorithm.mini_batches"
    ) in str(info.value)
    assert load_train_config(JOB, [*base, "algorithm.mini_batches=8"], check_plugins=False).algorithm.mini_batches == 8


def test_an_sft_stop_without_a_dev_set_is_refused() -> None:
    # probes4: sft.stop_at_accuracy with no sft.dev_path passed check and the warm start ran
    # all of sft.steps (the dev accuracy it stops on is never measured) without a word
    with pytest.raises(ConfigError, match=r"sft: stop_at_accuracy .* sft.dev_path, which is not set"):
        load_train_config(JOB, ["sft.dev_path=null"], check_plugins=False)
    # the same section while the warm start is off is left alone
    config = load_train_config(JOB, ["sft.dev_path=null", "sft.enabled=false"], check_plugins=False)
    assert config.sft.stop_at_accuracy == 0.3
