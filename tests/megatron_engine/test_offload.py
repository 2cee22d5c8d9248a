"""Offload / onload of the megatron engine: every storage is really released and comes back
bitwise (training after offload + onload equals training without it), and the memory the
gradient buffer held is returned to the OS (resident set measured)."""

from __future__ import annotations

import pytest
import torch
from geartrain.config import EngineConfig, ModelConfig, OptimConfig
from geartrain.engine import Engine

from .common import make_batch, make_engine, rank_context, token_mean_loss

ALL = frozenset({"params", "grads", "optimizer"})


def _storages(engine: Engine) -> dict[str, list[int]]:
    from geartrain_megatron import offload

    model = engine.handle
    return {kind: [t.untyped_storage().nbytes() for t in fn(model)] for kind, fn in offload._TENSORS.items()}


def _weights(engine: Engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for m in engine.handle.modules for n, p in m.named_parameters()}


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["adam", "distributed_optimizer"])
def test_offload_mid_step_and_between_steps_is_bitwise(distributed_optimizer: bool) -> None:
    options = {"use_distributed_optimizer": distributed_optimizer}
    plain = make_engine("llama", 0, 1, options=options)
    moved = make_engine("llama", 0, 1, options=options)
    sizes = _storages(moved)
    losses: dict[str, list[float]] = {"plain": [], "moved": []}
    for step in range(3):
        batch = make_batch(20 + step)
        for name, engine in (("plain", plain), ("moved", moved)):
            out = engine.forward_backward(batch, token_mean_loss)
            losses[name].append(out.metrics["loss"])
            if name == "moved":
                # mid-step (gradients held) on step 1, between steps (all zero) otherwise
                stats = engine.offload(ALL)
                released = _storages(engine)
                assert all(n == 0 for kind in released.values() for n in kind), released
                for kind in ("params", "grads"):
                    assert stats.detail[f"{kind}_released_bytes"] == sum(sizes[kind]) > 0
                if step > 0:  # Adam's moments exist after the first step
                    assert stats.detail["optimizer_released_bytes"] > 0
                with pytest.raises(RuntimeError, match="offloaded"):
                    engine.optimizer_step()
                with pytest.raises(RuntimeError, match="reshard_for_rollout called while"):
                    engine.sync_weights(None)
                engine.onload()
                assert _storages(engine)["grads"] == sizes["grads"]
            engine.optimizer_step()
        # between steps the gradient buffer is zero: freed without a host copy
        stats = moved.offload(frozenset({"grads"}))
        assert stats.detail["grads_host_copy_bytes"] == 0 and stats.detail["grads_released_bytes"] > 0
        moved.onload()
    assert losses["moved"] == losses["plain"]
    w_plain, w_moved = _weights(plain), _weights(moved)
    for name, tensor in w_plain.items():
        assert torch.equal(tensor, w_moved[name]), name


def test_offloading_the_gradient_buffer_returns_its_memory() -> None:
    """A model whose gradient buffer (~34 MB) is above glibc's largest mmap threshold, so
    freeing it must show in the resident set on CPU (device memory on GPU)."""
    model = ModelConfig(
        tiny="llama",
        seed=1,
        config_overrides={"num_hidden_layers": 2, "hidden_size": 512, "intermediate_size": 2048},
    )
    config = EngineConfig(backend="megatron", optim=OptimConfig(lr=1e-3))
    engine = Engine(config, model, rank_context(0, 1))
    engine.forward_backward(make_batch(1), token_mean_loss)
    engine.optimizer_step()
    stats = engine.offload(frozenset({"grads"}))
    grad_bytes = stats.detail["grads_released_bytes"]
    assert grad_bytes > 32 << 20
    assert stats.freed >= 0.9 * grad_bytes, (stats.before, stats.after, grad_bytes)
    back = engine.onload()
    assert back.after - back.before >= 0.9 * grad_bytes
    assert engine.handle.modules[0].embedding.word_embeddings.weight.main_grad.abs().sum() == 0
