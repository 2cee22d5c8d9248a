"""``gradient_checkpointing = true`` on the packed paths: backward recomputes each layer,
its attention included, so the packed-attention state must be live during backward too.
Gradients equal the run without checkpointing, in one process and on a one-rank FSDP2
group with CPU offload (as a one-GPU job with ``cpu_offload`` runs)."""

from __future__ import annotations

import pytest
import torch
from geartrain.cluster.process_group import acquire_single_rank_group, release_single_rank_group
from geartrain.config import EngineConfig, ModelConfig
from geartrain.engine import Engine
from geartrain.types import EngineContext

from .common import engine_config, full_grads, token_mean_loss
from .test_prefix_sharing import group_batch


def build(checkpointing: bool, share: bool, group: object | None) -> Engine:
    # several micro-batches; with a group, FSDP2 with CPU offload on one rank (as on one GPU)
    options = {"share_prompt_prefix": share, "cpu_offload": group is not None}
    cfg = engine_config(budget=40, options=options)
    cfg = EngineConfig(**{**cfg.model_dump(), "gradient_checkpointing": checkpointing})
    return Engine(cfg, ModelConfig(tiny="qwen2"), EngineContext(role="actor", process_group=group))


@pytest.mark.parametrize("fsdp", [False, True], ids=["one-process", "fsdp-one-rank"])
@pytest.mark.parametrize("share", [False, True], ids=["packed", "shared-prompts"])
def test_gradient_checkpointing_gives_the_same_gradients(fsdp: bool, share: bool) -> None:
    group = acquire_single_rank_group("cpu") if fsdp else None
    try:
        batch = group_batch(seed=4)
        plain, ckpt = build(False, share, group), build(True, share, group)
        assert ckpt.handle.meshes.distributed == fsdp
        a = plain.forward_backward(batch, token_mean_loss)
        b = ckpt.forward_backward(batch, token_mean_loss)
        assert a.metrics["micro_batches"] > 1
        torch.testing.assert_close(b.outputs["log_probs"], a.outputs["log_probs"], atol=1e-6, rtol=0)
        ga, gb = full_grads(plain), full_grads(ckpt)
        for name in ga:
            torch.testing.assert_close(gb[name], ga[name], atol=1e-6, rtol=1e-5)
    finally:
        if group is not None:
            release_single_rank_group(group)


def test_cpu_offload_on_one_rank_shards_with_fsdp2_from_a_hand_built_context() -> None:
    # the core supplies a size-1 group to EngineContext(role=...); cpu_offload must not be a no-op there
    from torch.distributed.fsdp import CPUOffloadPolicy

    cfg = engine_config(options={"cpu_offload": True})
    engine = Engine(cfg, ModelConfig(tiny="qwen2"), EngineContext(role="actor"))
    assert engine.handle.meshes.distributed
    state = engine.handle.module._get_fsdp_state()
    assert isinstance(state._fsdp_param_group.offload_policy, CPUOffloadPolicy)
