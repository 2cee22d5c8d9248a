"""``options.compile``: regional compilation of the decoder layers
(:mod:`geartrain_fsdp.compiling`) computes what the eager engine computes, in fp32 and
within float tolerance: log-probs and entropy, the loss, the gradients and the weights
after an optimizer step; on packed, shared-prompt and padded micro-batches, with gradient
checkpointing, with LoRA adapters, for a value model under one-rank FSDP2 with CPU offload,
and on two gloo ranks (FSDP2 + Ulysses sp = 2 + gradient checkpointing). And
it compiles for real: graphs are captured, and micro-batches of new token counts reuse
them (``dynamic=True``) instead of recompiling.

Most tests use the ``aot_eager`` backend (dynamo + AOTAutograd graphs, forward and
backward, without inductor's code generation: seconds instead of tens of seconds per
cold compile); one runs inductor itself (C++ kernels on CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from geartrain.config import EngineConfig, LoraConfig, ModelConfig
from geartrain.engine import Engine
from geartrain.errors import ConfigError
from geartrain.types import EngineContext
from geartrain_fsdp.options import FSDPOptions
from torch._dynamo.utils import counters

from .common import (
    engine_config,
    full_grads,
    full_params,
    make_batch,
    make_engine,
    run_ranks,
    token_mean_loss,
    value_loss,
)
from .test_prefix_sharing import group_batch
from .workers import compile_pair_step

LAYOUTS = {
    "packed": {"share_prompt_prefix": False},
    "shared-prompts": {"share_prompt_prefix": True},
    "padded": {"remove_padding": False},
}


def build(
    compile_: bool,
    *,
    layout: str = "shared-prompts",
    checkpointing: bool = False,
    backend: str = "aot_eager",
    value_head: bool = False,
    options: dict | None = None,
    **extra: Any,
) -> Engine:
    options = {**LAYOUTS[layout], **(options or {}), "compile": compile_, "compile_backend": backend}
    cfg = engine_config(budget=40, options=options)
    cfg = EngineConfig(**{**cfg.model_dump(), "gradient_checkpointing": checkpointing, **extra})
    model = ModelConfig(tiny="qwen2", seed=1, value_head=value_head)
    return Engine(cfg, model, EngineContext(role="critic" if value_head else "actor"))


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    # compiled graphs live on the layer class's code object, shared by every engine in the
    # process: start each test from none, so that its graph counts are its own
    torch._dynamo.reset()


def graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def trainable_grads(engine: Engine) -> dict[str, torch.Tensor]:
    """Full gradients of the parameters that get them (LoRA: the adapters only)."""
    return {k: p.grad.detach().clone() for k, p in engine.handle.hf.named_parameters() if p.requires_grad}


def compare(eager: Engine, compiled: Engine, batch: Any) -> None:
    """Log-probs + entropy (forward only), then one training step: outputs, loss,
    gradients and the updated weights."""
    before = graphs()
    a = eager.compute_log_probs(batch, entropy=True)
    b = compiled.compute_log_probs(batch, entropy=True)
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(b.outputs[key], a.outputs[key], atol=1e-5, rtol=0)
    a = eager.forward_backward(batch, token_mean_loss)
    b = compiled.forward_backward(batch, token_mean_loss)
    assert graphs() > before, "options.compile captured no graph"
    assert a.metrics["micro_batches"] > 1
    torch.testing.assert_close(b.outputs["log_probs"], a.outputs["log_probs"], atol=1e-5, rtol=0)
    assert b.metrics["loss"] == pytest.approx(a.metrics["loss"], abs=1e-6)
    ga, gb = trainable_grads(eager), trainable_grads(compiled)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], atol=1e-6, rtol=1e-4)
    eager.optimizer_step()
    compiled.optimizer_step()
    pa, pb = full_params(eager), full_params(compiled)
    assert pa.keys() == pb.keys()  # no _orig_mod in the names: checkpoints and sync are unchanged
    # AdamW's first step moves each weight by ~lr * g / (|g| + eps) (lr = 1e-3): where g is
    # near eps, float rounding of g shows; 1e-5 is 1 % of a step
    for name in pa:
        torch.testing.assert_close(pb[name], pa[name], atol=1e-5, rtol=0)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "grad-checkpointing"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_layers_match_eager(layout: str, checkpointing: bool) -> None:
    eager = build(False, layout=layout, checkpointing=checkpointing)
    compiled = build(True, layout=layout, checkpointing=checkpointing)
    compare(eager, compiled, group_batch(seed=4))


def test_value_model_with_cpu_offload_matches_eager() -> None:
    # a critic on a one-rank FSDP2 group with CPU offload (as a one-GPU job with cpu_offload)
    eager, compiled = (build(c, value_head=True, options={"cpu_offload": True}) for c in (False, True))
    assert compiled.handle.meshes.distributed
    batch = group_batch(seed=4)
    before = graphs()
    a, b = eager.forward_backward(batch, value_loss), compiled.forward_backward(batch, value_loss)
    assert graphs() > before
    torch.testing.assert_close(b.outputs["values"], a.outputs["values"], atol=1e-5, rtol=0)
    ga, gb = full_grads(eager), full_grads(compiled)
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], atol=1e-6, rtol=1e-4)


def test_inductor_matches_eager() -> None:
    compare(build(False), build(True, backend="inductor"), group_batch(seed=4, prompts=5))


def test_lora_layers_compile_with_their_adapters() -> None:
    lora = {"lora": LoraConfig(rank=4, alpha=8)}
    eager, compiled = build(False, **lora), build(True, **lora)
    compare(eager, compiled, group_batch(seed=4, n=4))
    # the base alone (adapters off, as the reference policy runs) too
    a = eager.compute_log_probs(group_batch(seed=7), adapters_off=True)
    b = compiled.compute_log_probs(group_batch(seed=7), adapters_off=True)
    torch.testing.assert_close(b.outputs["log_probs"], a.outputs["log_probs"], atol=1e-5, rtol=0)


def test_new_token_counts_reuse_the_compiled_graphs() -> None:
    # dynamic=True: the token dimension is symbolic, so micro-batches of other lengths
    # (other batches, other packings) run the graphs of the first step
    engine = build(True, layout="packed")
    start = graphs()
    engine.forward_backward(make_batch(0, rows=6), token_mean_loss)
    engine.compute_log_probs(make_batch(0, rows=6))
    first = graphs()
    assert first > start
    lengths = set()
    for seed in (1, 2, 3):
        batch = make_batch(seed, rows=5, prompt_max=9, response_max=11)
        lengths.add(int(batch["attention_mask"].sum()))
        engine.forward_backward(batch, token_mean_loss)
        engine.compute_log_probs(batch)
    assert len(lengths) > 1
    assert graphs() == first


def test_two_ranks_fsdp_and_sequence_parallel_match_eager() -> None:
    # one gloo group of 2: FSDP2 over both ranks, Ulysses sp = 2 (the all-to-all runs
    # inside the eager attention between the compiled graphs), gradient checkpointing
    # (FSDP2 re-gathers the weights for the compiled recomputation)
    for rank in run_ranks(compile_pair_step, 2):
        eager, compiled = rank["eager"], rank["compiled"]
        assert rank["graphs"] > 0
        torch.testing.assert_close(compiled["log_probs"], eager["log_probs"], atol=1e-5, rtol=0)
        assert compiled["loss"] == pytest.approx(eager["loss"], abs=1e-6)
        for name, g in eager["grads"].items():
            torch.testing.assert_close(compiled["grads"][name], g, atol=1e-6, rtol=1e-4)


def test_unknown_backend_is_refused_with_the_option_named() -> None:
    with pytest.raises(ConfigError, match="compile_backend.*unknown torch.compile backend 'nope'"):
        build(True, backend="nope")


def test_compile_is_on_by_default_on_cuda_only() -> None:
    """Issue 33 item 6: unset, ``options.compile`` is on for CUDA engines, off on CPU; set,
    it is what it says. The CPU engine built with the default compiles nothing."""
    default = FSDPOptions()
    assert default.compile is None
    assert default.compiles(torch.device("cuda", 0)) and not default.compiles(torch.device("cpu"))
    assert not FSDPOptions(compile=False).compiles(torch.device("cuda", 0))
    assert FSDPOptions(compile=True).compiles(torch.device("cpu"))
    engine = make_engine()
    assert not any(getattr(layer, "_geartrain_compiled", False) for layer in engine.handle.hf.model.layers)
