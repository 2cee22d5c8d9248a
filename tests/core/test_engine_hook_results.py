"""A hook that returns ``None`` is told apart from a hook that is not implemented: pluggy's
first-result call gives ``None`` for both, and the fixes differ (a missing ``return`` in the
plugin's code vs. a capability the engine does not have)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from geartrain import Engine, hookimpl, plugins
from geartrain.batch import Batch
from geartrain.config import EngineConfig, ModelConfig
from geartrain.errors import GeartrainError
from geartrain.types import EngineContext


class _ForgetfulEngine:
    """A fake engine (it trains nothing) whose hooks forget their ``return``; it implements
    no ``offload``."""

    @hookimpl
    def build_model(self, config, ctx):  # noqa: ANN001, ANN201
        return torch.nn.Linear(2, 1)

    @hookimpl
    def shard(self, module, config, model_config, ctx):  # noqa: ANN001, ANN201
        return module

    @hookimpl
    def forward_backward(self, model, batch, loss_fn, forward_only):  # noqa: ANN001, ANN201
        model(batch["x"]).sum().backward()  # the work is done; the StepOutput is never returned

    @hookimpl
    def optimizer_step(self, model):  # noqa: ANN001, ANN201
        pass

    @hookimpl
    def reshard_for_rollout(self, model, rollout):  # noqa: ANN001, ANN201
        pass

    @hookimpl
    def save_checkpoint(self, model, path, extra):  # noqa: ANN001, ANN201
        pass

    @hookimpl
    def load_checkpoint(self, model, path):  # noqa: ANN001, ANN201
        return {}


@pytest.fixture
def engine() -> Iterator[Engine]:
    plugins.register_engine("forgetful-test", _ForgetfulEngine())
    try:
        yield Engine(EngineConfig(backend="forgetful-test"), ModelConfig(tiny="qwen2"), EngineContext(role="actor"))
    finally:
        plugins.unregister("engine", "forgetful-test")


def test_a_hook_returning_none_is_named_as_such_with_what_it_must_return(engine: Engine) -> None:
    with pytest.raises(GeartrainError) as caught:
        engine.forward_backward(Batch({"x": torch.ones(1, 2)}))
    message = str(caught.value)
    assert "returned None from its 'forward_backward' hook" in message
    assert "must return StepOutput" in message and "(_ForgetfulEngine)" in message  # the plugin that forgot
    assert "does not implement" not in message

    with pytest.raises(GeartrainError, match=r"returned None from its 'optimizer_step' hook .*must return dict"):
        engine.optimizer_step()
    with pytest.raises(GeartrainError, match=r"returned None from its 'reshard_for_rollout' hook .*must return SyncSt"):
        engine.sync_weights(None)


def test_a_hook_with_no_implementation_is_called_not_implemented(engine: Engine) -> None:
    with pytest.raises(GeartrainError, match=r"^engine 'forgetful-test' does not implement the 'offload' hook$"):
        engine.offload()
