"""``rollout.replica_restarts`` is refused, naming the key and the fix, where it would do
nothing (a colocated rollout), and taken with the separate rollout, synchronous or streamed.
Checked before any plugin loads."""

from __future__ import annotations

from pathlib import Path

import pytest
from geartrain.errors import ConfigError
from geartrain.trainer import load_train_config

MAIN_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "arithmetic" / "grpo.toml"
SEPARATE = ["cluster.placement=ray", "rollout.placement=separate", "rollout.replicas=2"]


def _problems(*overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        load_train_config(MAIN_CONFIG, list(overrides), check_plugins=False)
    return dict(err.value.problems)


def test_replica_restarts_is_refused_where_it_would_do_nothing() -> None:
    colocated = _problems("rollout.replica_restarts=1")["rollout.replica_restarts"]
    assert "separate rollout only" in colocated and 'set rollout.placement = "separate"' in colocated, colocated
    assert (
        "greater than or equal to 0" in _problems(*SEPARATE, "rollout.replica_restarts=-1")["rollout.replica_restarts"]
    )


@pytest.mark.parametrize("k", [0, 1])
def test_replica_restarts_is_taken_with_the_separate_rollout(k: int) -> None:
    overrides = [*SEPARATE, f"algorithm.max_staleness={k}", "rollout.replica_restarts=2"]
    assert load_train_config(MAIN_CONFIG, overrides, check_plugins=False).rollout.replica_restarts == 2
    assert load_train_config(MAIN_CONFIG, [], check_plugins=False).rollout.replica_restarts == 0
