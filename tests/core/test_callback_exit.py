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
