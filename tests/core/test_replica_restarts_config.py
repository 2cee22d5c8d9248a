"""``rollout.replica_restarts`` is refused, naming the key and the fix, where it would do
nothing: a colocated rollout, and the streamed separate rollout (``max_staleness >= 1``,
where requests in flight are not resent yet). Checked before any plugin loads."""

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
    streamed = _problems(*SEPARATE, "algorithm.max_staleness=1", "rollout.replica_restarts=1")
    assert "max_staleness = 0 only" in streamed["rollout.replica_restarts"], streamed
    assert "set algorithm.max_staleness = 0, or rollout.replica_restarts = 0" in streamed["rollout.replica_restarts"]
    assert (
        "greater than or equal to 0" in _problems(*SEPARATE, "rollout.replica_restarts=-1")["rollout.replica_restarts"]
    )


def test_replica_restarts_is_taken_with_the_synchronous_separate_rollout() -> None:
    config = load_train_config(MAIN_CONFIG, [*SEPARATE, "rollout.replica_restarts=2"], check_plugins=False)
    assert config.rollout.replica_restarts == 2
    assert load_train_config(MAIN_CONFIG, [], check_plugins=False).rollout.replica_restarts == 0
