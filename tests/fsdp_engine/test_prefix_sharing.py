"""Shared-prompt packing (``share_prompt_prefix``): a GRPO batch (each prompt ``n`` times)
gives the same log-probs, entropy, values, loss and gradients as packing every row on its
own, and as plain transformers; and it really runs each prompt once."""

from __future__ import annotations

import pytest
import torch
from geartrain.batch import Batch
from geartrain.testing import tiny_model
from geartrain_fsdp.prefix_sharing import SegmentAttention, has_standard_layout, pack_shared, scatter_outputs

from .common import full_grads, make_engine, reference_outputs, token_mean_loss, value_loss


def group_batch(seed: int = 0, prompts: int = 4, n: int = 3, prompt_max: int = 6, response_max: int = 5) -> Batch:
    """``prompts`` random prompts, each followed by ``n`` random responses (some empty),
    in the layout :mod:`geartrain.layout` builds; rows prompt-major as a rollout returns."""
    g = torch.Generator().manual_seed(seed)
    width = prompt_max + response_max
    rows = prompts * n
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    loss_mask = torch.zeros(rows, width, dtype=torch.long)
    for i in range(prompts):
        p = int(torch.randint(1, prompt_max + 1, (1,), generator=g))
        prompt = torch.randint(4, 128, (p,), generator=g)
        for j in range(n):
            r = i * n + j
            a = int(torch.randint(0 if j == n - 1 else 1, response_max + 1, (1,), generator=g))
            ids[r, prompt_max - p : prompt_max] = prompt
            ids[r, prompt_max : prompt_max + a] = torch.randint(4, 128, (a,), generator=g)
            mask[r, prompt_max - p : prompt_max + a] = 1
            loss_mask[r, prompt_max : prompt_max + a] = 1
    return Batch({"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}, info={"prompt_length": prompt_max})


def test_pack_shared_runs_each_prompt_once_and_maps_every_output() -> None:
    batch = group_batch(prompts=3, n=4)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert has_standard_layout(mask, 6)
    packed = pack_shared(ids, mask, 6)
    prompt_tokens = mask[:, :6].sum(1)
    response_tokens = mask[:, 6:].sum(1)
    # each prompt once, every response token once
    assert packed.num_tokens == int(prompt_tokens[::4].sum() + response_tokens.sum())
    assert len(packed.segments) == 3
    # every output slot of the [b, T] layout (each row's real tokens but the first) is
    # filled with the token that sits there
    flat_ids = ids.flatten()
    assert torch.equal(packed.out_targets[packed.expand], flat_ids[packed.dest])
    expected = (mask.bool() & (mask.cumsum(1) > 1)).flatten().nonzero().squeeze(1)
    assert torch.equal(packed.dest.sort().values, expected)
    # positions: as in each token's own row
    pos = (mask.cumsum(1) - 1).flatten()
    src_pos = packed.position_ids[0][packed.out_positions[packed.expand]]
    assert torch.equal(src_pos + 1, pos[packed.dest])
    # scatter puts the values where dest says
    values = torch.arange(len(packed.out_targets), dtype=torch.float32)
    out = scatter_outputs(values, packed).flatten()
    assert torch.equal(out[packed.dest], values[packed.expand])


def test_segment_mask_lets_a_response_see_its_prompt_and_itself_only() -> None:
    batch = group_batch(prompts=2, n=3, seed=3)
    packed = pack_shared(batch["input_ids"], batch["attention_mask"], 6)
    layout = SegmentAttention.build(packed.segments, torch.device("cpu"))
    seg_of, block_of = {}, {}
    for s, seg in enumerate(packed.segments):
        pos = seg.start
        for _ in range(seg.prefix):
            seg_of[pos], block_of[pos] = s, 0
            pos += 1
        for r, q in enumerate(seg.responses, start=1):
            for _ in range(q):
                seg_of[pos], block_of[pos] = s, r
                pos += 1
    for idx, allowed, valid in zip(layout.index, layout.allowed, layout.valid, strict=True):
        assert allowed.any(-1).all(), "a query row with no key gives NaN in some SDPA kernels"
        flat, width = idx.flatten(), idx.shape[1]
        real_slots = set(valid.tolist())
        for v in real_slots:
            k, i = divmod(v, width)
            qpos = int(flat[v])
            for j in range(width):
                kpos = int(idx[k, j])
                real = k * width + j in real_slots
                want = real and kpos <= qpos and block_of[kpos] in (0, block_of[qpos])
                assert bool(allowed[k, 0, i, j]) == want, (qpos, kpos)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_shared_prompts_equal_unshared_and_transformers(family: str) -> None:
    batch = group_batch(seed=1)
    batch.info["need_entropy"] = True
    shared = make_engine(family, budget=10_000)
    plain = make_engine(family, budget=10_000, options={"share_prompt_prefix": False})
    a = shared.forward_backward(batch, token_mean_loss)
    ga = full_grads(shared)
    b = plain.forward_backward(batch, token_mean_loss)
    gb = full_grads(plain)
    for key in ("log_probs", "entropy"):
        assert torch.allclose(a.outputs[key], b.outputs[key], atol=1e-5, rtol=0), key
    assert a.metrics["loss"] == pytest.approx(b.metrics["loss"], abs=1e-6)
    assert a.metrics["tokens"] == b.metrics["tokens"]
    for name in ga:
        assert torch.allclose(ga[name], gb[name], atol=1e-5, rtol=1e-4), name
    ref = reference_outputs(tiny_model(family), batch)
    for key in ("log_probs", "entropy"):
        assert torch.allclose(a.outputs[key], ref[key].detach(), atol=1e-5, rtol=0), key


def test_shared_prompts_keep_a_group_in_one_micro_batch_and_match_across_budgets() -> None:
    batch = group_batch(seed=2, prompts=5, n=4)
    one = make_engine(budget=10_000).forward_backward(batch, token_mean_loss)
    engine = make_engine(budget=30)
    many = engine.forward_backward(batch, token_mean_loss)
    assert many.metrics["micro_batches"] > 1
    assert torch.allclose(one.outputs["log_probs"], many.outputs["log_probs"], atol=1e-5, rtol=0)
    assert one.metrics["loss"] == pytest.approx(many.metrics["loss"], abs=1e-6)


def test_shared_prompts_value_model() -> None:
    batch = group_batch(seed=4)
    shared = make_engine(value_head=True)
    plain = make_engine(value_head=True, options={"share_prompt_prefix": False})
    a = shared.forward_backward(batch, value_loss)
    b = plain.forward_backward(batch, value_loss)
    assert torch.allclose(a.outputs["values"], b.outputs["values"], atol=1e-5, rtol=0)
    ga, gb = full_grads(shared), full_grads(plain)
    for name in ga:
        assert torch.allclose(ga[name], gb[name], atol=1e-5, rtol=1e-4), name
