"""``geartrain check`` on the shipped job files (run by the command's ``main()`` in the test
process: :func:`e2e_helpers.check_in_process`)."""

from __future__ import annotations

import importlib.util

import pytest
from e2e_helpers import ROOT, check_in_process

GSM8K = ROOT / "examples" / "gsm8k" / "grpo_qwen2.5_0.5b_vllm.toml"


def test_main_job_config_checks_with_its_plugins() -> None:
    proc = check_in_process("--overwrite", str(ROOT / "examples" / "arithmetic" / "grpo.toml"))
    assert proc.returncode == 0, proc.stderr
    assert "ok (grpo with actor engine 'fsdp' and rollout 'torch')" in proc.stdout


ARITHMETIC_RECIPES = {
    "grpo": "grpo",
    "dr_grpo": "dr_grpo",
    "dapo": "grpo",
    "rloo": "rloo",
    "reinforce_pp": "reinforce_plus_plus",
    "gspo": "grpo",
    "ppo": "gae",
    "otb": "optimal_token_baseline",
}


@pytest.mark.parametrize("name", sorted(ARITHMETIC_RECIPES))
def test_arithmetic_recipe_per_family_checks(name: str) -> None:
    """Each family's recipe passes `geartrain check` and selects what its name says."""
    from geartrain.trainer import load_train_config

    path = ROOT / "examples" / "arithmetic" / f"{name}.toml"
    proc = check_in_process("--overwrite", str(path))
    assert proc.returncode == 0, proc.stderr
    algo = load_train_config(str(path)).algorithm
    assert algo.estimator == ARITHMETIC_RECIPES[name]
    assert (algo.policy_loss == "gspo") == (name == "gspo")
    assert algo.dynamic_sampling == (name == "dapo")
    readme = (ROOT / "README.md").read_text()
    assert f"examples/arithmetic/{name}.toml" in readme


def test_an_unregistered_algorithm_fails_the_check() -> None:
    rloo = ROOT / "examples" / "arithmetic" / "rloo.toml"
    proc = check_in_process("--overwrite", str(rloo), "algorithm.advantage=rlooo")
    assert proc.returncode == 2
    assert "algorithm" in proc.stderr and "'rlooo' is not a registered estimator" in proc.stderr


def test_gsm8k_vllm_recipe_checks_without_its_plugins() -> None:
    proc = check_in_process("--overwrite", str(GSM8K), "--no-plugins", "--config-only")
    assert proc.returncode == 0, proc.stderr
    assert "ok (grpo with actor engine 'fsdp' and rollout 'vllm')" in proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("geartrain_vllm") is not None, reason="vllm plugin installed here")
def test_gsm8k_vllm_recipe_names_the_missing_plugin() -> None:
    proc = check_in_process("--overwrite", str(GSM8K))
    assert proc.returncode == 2
    assert "rollout.backend" in proc.stderr and "pip install './plugins/vllm_rollout[cpu]'" in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("geartrain_vllm") is None, reason="needs the vllm plugin")
def test_gsm8k_vllm_recipe_checks_with_the_vllm_plugin() -> None:
    proc = check_in_process("--overwrite", str(GSM8K), "--config-only")
    assert proc.returncode == 0, proc.stderr


def test_a_typo_is_reported_with_its_path() -> None:
    proc = check_in_process(
        "--overwrite",
        str(GSM8K),
        "--no-plugins",
        "--config-only",
        "algorithm.clip_ratio=-1",
        "trainer.totl_steps=3",
    )
    assert proc.returncode == 2
    assert "algorithm.clip_ratio" in proc.stderr and "trainer.totl_steps" in proc.stderr


@pytest.mark.parametrize("name", ["grpo_cpu", "ppo_cpu"])
def test_packaged_recipes_validate(name: str) -> None:
    from importlib.resources import files

    from geartrain.trainer import load_train_config

    config = load_train_config(str(files("geartrain") / "recipes" / f"{name}.toml"), ["data.path=x.jsonl"])
    assert config.algorithm.name == name.split("_")[0]
    assert config.actor.engine.backend == "fsdp" and config.rollout.backend == "torch"


def test_agent_otb_recipe_checks_with_the_multi_turn_estimator() -> None:
    config = ROOT / "examples" / "calculator" / "tir_otb.toml"
    proc = check_in_process("--overwrite", str(config))
    assert proc.returncode == 0, proc.stderr
    assert "ok (grpo with actor engine 'fsdp' and rollout 'torch')" in proc.stdout


def test_agent_job_config_checks_and_a_missing_environment_is_named(tmp_path) -> None:  # noqa: ANN001
    config = ROOT / "examples" / "calculator" / "grpo.toml"
    proc = check_in_process("--overwrite", str(config))
    assert proc.returncode == 0, proc.stderr
    assert "ok (grpo with actor engine 'fsdp' and rollout 'torch')" in proc.stdout
    proc = check_in_process("--overwrite", str(config), "rollout.agent.environment=missing.py:Calculator")
    assert proc.returncode != 0
    assert "rollout.agent.environment" in proc.stderr and "missing.py" in proc.stderr
