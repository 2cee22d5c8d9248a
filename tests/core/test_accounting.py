"""geartrain.accounting (issue 33 item 8): token, pair, FLOP and byte counts against
numbers worked out by hand."""

from __future__ import annotations

import pytest
from geartrain.accounting import (
    ModelShape,
    attended_pairs,
    computed_tokens,
    decode_call_roofline,
    decode_roofline_s,
    update_flops,
)
from geartrain.presets import preset_config

# two prompts of 10 and 6 tokens, three samples each
ROWS = [(10, 4), (10, 5), (10, 6), (6, 2), (6, 2), (6, 3)]
GROUPS = [0, 0, 0, 1, 1, 1]


def test_shared_prompt_batch_counts_each_prompt_once() -> None:
    assert computed_tokens(ROWS) == 14 + 15 + 16 + 8 + 8 + 9 == 70
    assert computed_tokens(ROWS, GROUPS) == (10 + 4 + 5 + 6) + (6 + 2 + 2 + 3) == 38
    # causal pairs: prompt p(p+1)/2 once; each response r*p + r(r+1)/2
    shared = (55 + (40 + 10) + (50 + 15) + (60 + 21)) + (21 + (12 + 3) + (12 + 3) + (18 + 6))
    assert attended_pairs(ROWS, GROUPS) == shared == 326
    unshared = sum(s * (s + 1) // 2 for s in (14, 15, 16, 8, 8, 9))
    assert attended_pairs(ROWS) == unshared == 105 + 120 + 136 + 36 + 36 + 45
    assert attended_pairs(ROWS, convention="square") == 196 + 225 + 256 + 64 + 64 + 81
    with pytest.raises(ValueError, match="group 0 has prompts of 10 and 7"):
        computed_tokens([(10, 1), (7, 1)], [0, 0])


def test_the_issue20_lora_bench_batch_computed_18432_of_32768_tokens() -> None:
    """64 rows of 256 + 256 tokens, 8 samples per prompt, shared prompts: the '41 % MFU'
    counted 32,768 tokens, the engine computed 18,432 (8 x 256 + 64 x 256)."""
    rows = [(256, 256)] * 64
    assert computed_tokens(rows) == 32_768
    assert computed_tokens(rows, [i // 8 for i in range(64)]) == 18_432


def test_matmul_params_of_the_qwen_presets() -> None:
    small = ModelShape.from_config(preset_config("qwen2.5-0.5b"))
    # 24 layers x (q 896x896, k/v 896x128, o 896x896, MLP 3 x 896x4864) + tied output 151,936 x 896
    per_layer = 2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864
    assert small.matmul_params == 24 * per_layer + 151_936 * 896 == 493_961_216
    assert 494_032_768 - small.matmul_params == 24 * (896 + 2 * 128) + 2 * 24 * 896 + 896  # biases + norms
    tied = ModelShape.from_config(preset_config("qwen2.5-1.5b"))  # tied as well
    assert tied.matmul_params == 28 * (2 * 1536 * 1536 + 2 * 1536 * 256 + 3 * 1536 * 8960) + 151_936 * 1536
    untied = ModelShape.from_config(preset_config("qwen2.5-7b"))
    # untied: the 545M-parameter input embedding is a lookup, not in N
    assert untied.matmul_params == 28 * (2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944) + 152_064 * 3584
    assert 7_615_616_512 - untied.matmul_params > 152_064 * 3584
    assert small.kv_bytes_per_token(2) == 2 * 24 * 2 * 64 * 2 == 12_288


def test_update_flops_full_lora_and_square_convention() -> None:
    shape = ModelShape(layers=2, hidden=8, heads=4, kv_heads=2, head_dim=2, intermediate=16, vocab=10)
    n = shape.matmul_params
    assert n == 2 * (2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16) + 10 * 8 == 1_232
    attn = 12 * 2 * 4 * 2
    assert update_flops(shape, ROWS, GROUPS) == 6 * n * 38 + attn * 326
    assert update_flops(shape, ROWS, GROUPS, lora=True) == 4 * n * 38 + attn * 326
    square = 196 + 225 + 256 + 64 + 64 + 81
    assert update_flops(shape, ROWS, GROUPS, convention="square") == 6 * n * 70 + attn * square


def test_decode_roofline_reads_the_live_kv_cache() -> None:
    shape = ModelShape(layers=1, hidden=4, heads=2, kv_heads=1, head_dim=2, intermediate=8, vocab=6)
    kv = shape.kv_bytes_per_token(2)  # 2 x 1 x 1 x 2 x 2 = 8 bytes per token
    assert kv == 8
    # two rows, prompts 3 and 5; 3 and 2 tokens generated: step 1 both live (contexts 4, 6),
    # step 2 only row 0 (context 5)
    got = decode_call_roofline(shape, 100, [3, 5], [3, 2], 2, bandwidth=10.0, peak=1e9)
    assert got["steps"] == 2
    assert got["first_bytes_per_step"] == 100 + (4 + 6) * 8 == 180
    assert got["last_bytes_per_step"] == 100 + 5 * 8 == 140
    assert got["seconds"] == pytest.approx(18.0 + 14.0)
    # compute-bound when the peak is low: 2 N rows / peak
    n = shape.matmul_params
    assert decode_roofline_s(180, 2, n, bandwidth=1e12, peak=1.0) == 2 * n * 2
