"""The megatron engine at TP2 and at PP2 (2 Ray ranks each) trains exactly like the FSDP
engine (one rank, in this process) from the same HF weights on the same batches: ten
steps' losses and gradient norms within 1e-4, and the weights after them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from geartrain.batch import Batch
from geartrain.cluster.process_group import acquire_single_rank_group
from geartrain.config import EngineConfig, ModelConfig, OptimConfig, ParallelConfig
from geartrain.engine import Engine
from geartrain.testing.engine_suite import RecordingReceiver
from geartrain.testing.reference import make_batch, token_mean_nll_loss
from geartrain.types import EngineContext

pytest.importorskip("geartrain_megatron")

pytestmark = [pytest.mark.slow]

STEPS = 10
#: warmup then cosine decay, clipping active (the first steps' norms exceed 1)
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.01, clip_grad=1.0, lr_schedule="cosine", warmup_steps=2, total_steps=STEPS)
MODEL = ModelConfig(tiny="qwen2", seed=5, config_overrides={"num_hidden_layers": 4})
#: small enough that each step runs several micro-batches
BUDGET = 40


def _batch(step: int) -> Batch:
    g = torch.Generator().manual_seed(100 + step)
    prompts = torch.randint(1, 8, (6,), generator=g).tolist()
    responses = torch.randint(1, 10, (6,), generator=g).tolist()
    return make_batch(prompts, responses, seed=step)


def _train(engine: Engine) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    losses, norms = [], []
    for step in range(STEPS):
        out = engine.forward_backward(_batch(step), token_mean_nll_loss)
        stats = engine.optimizer_step()
        assert stats["skipped"] == 0.0
        losses.append(out.metrics["loss"])
        norms.append(stats["grad_norm"])
    receiver = RecordingReceiver()
    engine.sync_weights(receiver)
    return losses, norms, receiver.tensors


def _config(backend: str, **parallel: int) -> EngineConfig:
    return EngineConfig(
        backend=backend, parallel=ParallelConfig(**parallel), optim=OPTIM, max_tokens_per_micro_batch=BUDGET
    )


@pytest.fixture(scope="module")
def fsdp() -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    ctx = EngineContext(role="actor", seed=0, process_group=acquire_single_rank_group("cpu"))
    return _train(Engine(_config("fsdp"), MODEL, ctx))


@pytest.fixture(scope="module")
def placement() -> Iterator[object]:
    from geartrain.testing.multirank import start_placement

    placement = start_placement(2, 0.5)
    yield placement
    placement.close()


@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_ten_steps_match_the_fsdp_engine(layout: dict[str, int], fsdp: tuple, placement: object) -> None:
    from geartrain.testing.multirank import RankedEngine

    # one pool per layout: megatron-core keeps one layout per process
    engine = RankedEngine(placement, _config("megatron", **layout), MODEL, "actor", pool=f"megatron-{layout}")
    try:
        losses, norms, weights = _train(engine)  # type: ignore[arg-type]
    finally:
        engine.close()
    ref_losses, ref_norms, ref_weights = fsdp
    assert max(ref_norms) > OPTIM.clip_grad, "clipping never acted: the comparison would miss it"
    assert losses == pytest.approx(ref_losses, abs=1e-4)
    assert norms == pytest.approx(ref_norms, abs=1e-4)
    print(
        f"\n{layout}: max |loss diff| {max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)):.2e}, "
        f"max |grad norm diff| {max(abs(a - b) for a, b in zip(norms, ref_norms, strict=True)):.2e}"
    )
    assert set(weights) <= set(ref_weights)
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, ref_weights[name], atol=1e-4, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
