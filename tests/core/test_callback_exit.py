"""A callback that calls ``sys.exit`` does not end the run with exit 0 and no word (issue 35,
round 12: ``sys.exit(0)`` in ``on_step_end`` stopped the run at step 2 with exit 0, no
export, no curves): it is an error naming the callback, as any other failure of one."""

from __future__ import annotations

import sys

import pytest
from geartrain.errors import GeartrainError
from geartrain.trainer.callbacks import Callbacks


class Leaves:
    def __init__(self, *args: object) -> None:
        self.args = args

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        sys.exit(*self.args)


@pytest.mark.parametrize(("args", "said"), [((0,), "sys.exit(0)"), ((), "sys.exit()"), (("bye",), "sys.exit('bye')")])
def test_a_callback_calling_sys_exit_is_an_error_naming_it(args: tuple[object, ...], said: str) -> None:
    with pytest.raises(GeartrainError) as err:
        Callbacks([Leaves(*args)])("on_step_end", 2, {})
    assert str(err.value).startswith(f"callback Leaves.on_step_end called {said} (a callback cannot end the run")


class TrainerCallbackStyle:
    """A ``transformers.TrainerCallback`` as a TRL user writes one (without importing it)."""

    def on_step_end(self, args: object, state: object, control: object, **kwargs: object) -> None:
        pass


def test_a_callback_with_trl_signatures_is_refused_when_loaded() -> None:
    """Issue 35, round 14: a ``TrainerCallback`` subclass passed ``check`` and failed after RL
    step 1 with a TypeError naming an inherited method; a missing callback file passed
    ``check`` too (preflight now loads the callbacks as the run does)."""
    from geartrain.trainer.callbacks import load_callbacks

    with pytest.raises(GeartrainError) as err:
        load_callbacks([TrainerCallbackStyle()], None)
    assert str(err.value).startswith("trainer.callbacks[0]: TrainerCallbackStyle.on_step_end(args")
    assert "cannot be called as on_step_end(step, metrics)" in str(err.value)
    assert load_callbacks([Leaves(0)], None)  # (step, metrics): fine


def test_check_loads_the_jobs_callbacks() -> None:
    from pathlib import Path

    from geartrain.errors import ConfigError
    from geartrain.trainer import load_train_config
    from geartrain.trainer.preflight import preflight

    job = Path(__file__).resolve().parents[2] / "examples" / "arithmetic" / "grpo.toml"
    config = load_train_config(job, ["sft.enabled=false", 'trainer.callbacks=["nofile.py:X"]'], check_plugins=False)
    with pytest.raises(ConfigError) as err:
        preflight(config)
    assert "trainer.callbacks: callback file" in str(err.value) and "nofile.py' does not exist" in str(err.value)
