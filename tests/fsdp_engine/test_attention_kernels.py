"""The GPU attention kernels' layouts, checked on CPU against the engine's SDPA paths:
flex_attention's block mask (forward: torch 2.13 has no CPU backward for flex_attention)
and flash-attn's varlen layout (run through SDPA by ``varlen_reference``, forward and
backward), for packed sequences and for shared prompts."""

from __future__ import annotations

import pytest
import torch
from geartrain_fsdp import attention_kernels as ak
from geartrain_fsdp.prefix_sharing import SegmentAttention, pack_shared, segment_attention
from geartrain_fsdp.ulysses import varlen_causal_attention

from .common import full_grads, make_engine, token_mean_loss
from .test_prefix_sharing import group_batch

CU = [0, 5, 12, 13, 30, 37]  # lengths 5, 7, 1, 17, 7


def qkv(n: int, heads: int = 4, kv_heads: int = 2, d: int = 8, seed: int = 0, grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    shapes = [(1, heads, n, d), (1, kv_heads, n, d), (1, kv_heads, n, d)]
    return [torch.randn(s, generator=g, dtype=torch.float64).requires_grad_(grad) for s in shapes]


def shared_segments(seed: int = 3):
    batch = group_batch(prompts=3, n=4, seed=seed)  # includes empty responses
    return pack_shared(batch["input_ids"], batch["attention_mask"], 6).segments


def test_labels_describe_document_and_prefix_masks() -> None:
    allowed = ak.packed_labels(CU).allowed()
    for s, e in zip(CU[:-1], CU[1:], strict=True):  # causal inside each sequence, nothing across
        expected = torch.zeros(37, 37, dtype=torch.bool)
        expected[s:e, s:e] = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        assert torch.equal(allowed[s:e], expected[s:e])
    segments = shared_segments()
    dense = ak.shared_labels(segments).allowed()
    layout = SegmentAttention.build(segments, torch.device("cpu"))
    for idx, mask, valid in zip(layout.index, layout.allowed, layout.valid, strict=True):
        width = idx.shape[1]
        for v in valid.tolist():  # every real query of SDPA's bucketed masks
            k, i = divmod(v, width)
            real = [j for j in range(width) if k * width + j in set(valid.tolist())]
            for j in real:
                assert bool(mask[k, 0, i, j]) == bool(dense[idx[k, i], idx[k, j]])


def block_sets(mask) -> tuple[set, set]:  # noqa: ANN001
    """(blocks run with the mask function, blocks run without it) of a BlockMask."""

    def pairs(num, idx) -> set:  # noqa: ANN001
        return {(i, int(j)) for i in range(num.shape[-1]) for j in idx[0, 0, i, : int(num[0, 0, i])]}

    return pairs(mask.kv_num_blocks, mask.kv_indices), pairs(mask.full_kv_num_blocks, mask.full_kv_indices)


@pytest.mark.parametrize("shared", [False, True])
def test_flex_block_mask_skips_only_empty_blocks_and_masks_every_partial_one(shared: bool) -> None:
    from geartrain_fsdp.prefix_sharing import Segment

    segments = [Segment(start=0, prefix=20, responses=[17, 9, 0, 30]), Segment(start=76, prefix=12, responses=[25, 25])]
    labels = ak.shared_labels(segments) if shared else ak.packed_labels([0, 40, 47, 90, 91, 133])
    dense = labels.allowed()
    n, size = dense.shape[0], 8
    partial, full = block_sets(ak.flex_block_mask(labels, block_size=size))
    assert not partial & full
    blocks = -(-n // size)
    for i in range(blocks):
        for j in range(blocks):
            tile = dense[i * size : (i + 1) * size, j * size : (j + 1) * size]
            if bool(tile.any()):
                assert (i, j) in partial | full, (i, j)  # never skipped when a query sees a key
            if (i, j) in full:
                assert bool(tile.all()) and tile.shape == (size, size), (i, j)  # unmasked only when all visible
    assert len(partial | full) < blocks * (blocks + 1) // 2  # real sparsity below the diagonal
    assert full  # and some blocks skip the mask function


def test_flex_block_mask_equals_sdpa_for_packed_sequences() -> None:
    q, k, v = qkv(CU[-1])
    ref = varlen_causal_attention(q, k, v, CU, scaling=None)
    mask = ak.flex_block_mask(ak.packed_labels(CU), block_size=8)  # several blocks, some skipped
    with torch.no_grad():
        out = ak.flex_attention_call(q, k, v, mask, None)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


def test_flex_block_mask_equals_sdpa_for_shared_prompts() -> None:
    segments = shared_segments()
    n = sum(s.length for s in segments)
    q, k, v = qkv(n, seed=1)
    ref = segment_attention(q, k, v, SegmentAttention.build(segments, torch.device("cpu")), scaling=0.3)
    mask = ak.flex_block_mask(ak.shared_labels(segments), block_size=8)
    with torch.no_grad():
        out = ak.flex_attention_call(q, k, v, mask, 0.3)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("shared", [False, True])
def test_varlen_layout_equals_sdpa_forward_and_backward(shared: bool) -> None:
    segments = shared_segments()
    n = sum(s.length for s in segments) if shared else CU[-1]
    q, k, v = qkv(n, seed=2, grad=True)
    if shared:
        ref = segment_attention(q, k, v, SegmentAttention.build(segments, torch.device("cpu")), scaling=None)
        layout = ak.varlen_layout(segments=segments)
        assert layout.key_index is not None and len(layout.key_index) > n  # prompts' keys gathered per response
    else:
        ref = varlen_causal_attention(q, k, v, CU, scaling=None)
        layout = ak.varlen_layout(cu_seqlens=CU)
    out = ak.flash_varlen(q, k, v, layout, None, kernel=ak.varlen_reference)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    w = torch.randn_like(ref)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_choose_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert ak.choose_kernel("auto", cpu) == "sdpa"
    monkeypatch.setattr(ak, "_flash_function", lambda: None)
    assert ak.choose_kernel("auto", cuda) == "flex"
    with pytest.raises(ValueError, match=r"pip install './plugins/fsdp_engine\[flash-attn\]'"):
        ak.choose_kernel("flash", cpu)
    monkeypatch.setattr(ak, "_flash_function", lambda: ("fa2", ak.varlen_reference))
    assert ak.choose_kernel("auto", cuda) == "flash"
    assert ak.choose_kernel("auto", cuda, torch.float32) == "flex"  # flash-attn has no fp32 kernels
    with pytest.raises(ValueError, match="param_dtype = 'bfloat16'"):
        ak.choose_kernel("flash", cuda, torch.float32)


@pytest.mark.parametrize("share", [False, True])
def test_engine_with_flex_kernel_gives_the_sdpa_log_probs(share: bool) -> None:
    batch = group_batch(seed=1)
    batch.info["need_entropy"] = True
    opts = {"share_prompt_prefix": share}
    ref = make_engine(budget=10_000, options=opts).compute_log_probs(batch, entropy=True)
    out = make_engine(budget=10_000, options={**opts, "attention": "flex"}).compute_log_probs(batch, entropy=True)
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(out.outputs[key], ref.outputs[key], atol=1e-5, rtol=0)


@pytest.mark.parametrize("share", [False, True])
def test_engine_through_the_flash_layout_trains_like_sdpa(share: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # flash-attn's kernel replaced by its SDPA reference: the engine's plumbing (layout per
    # forward, [N, H, d] views, gathered prompt keys) forward and backward, in fp32 so it is
    # compared tightly (the real kernels are bf16/fp16 only, so the kernel is set by hand)
    monkeypatch.setattr(ak, "_flash_function", lambda: ("fa2", ak.varlen_reference))
    batch = group_batch(seed=2)
    opts = {"share_prompt_prefix": share}
    ref_engine = make_engine(budget=10_000, options=opts)
    flash_engine = make_engine(budget=10_000, options=opts)
    flash_engine.handle.attention_kernel = "flash"
    a = flash_engine.forward_backward(batch, token_mean_loss)
    b = ref_engine.forward_backward(batch, token_mean_loss)
    torch.testing.assert_close(a.outputs["log_probs"], b.outputs["log_probs"], atol=1e-5, rtol=0)
    ga, gb = full_grads(flash_engine), full_grads(ref_engine)
    for name in gb:
        torch.testing.assert_close(ga[name], gb[name], atol=1e-5, rtol=1e-4)


def test_flash_without_the_package_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from geartrain.errors import ConfigError

    monkeypatch.setattr(ak, "_flash_function", lambda: None)
    with pytest.raises(ConfigError, match=r"options.attention.*pip install"):
        make_engine(options={"attention": "flash"})
