"""Σπ² (``sum_pi_squared``) from the megatron engine at TP2: each rank holds half of the
vocabulary's logits, yet every rank returns the full-vocabulary ``Σ_v π(v)²`` of plain
PyTorch over a transformers forward's full logits, within 1e-5, from a forward and to the
loss of a micro-batched training step."""

from __future__ import annotations

import pytest
import torch
from geartrain.modeling import build_hf_model
from geartrain.testing.reference import reference_token_outputs, token_valid_mask

from .common import make_batch, model_config, run_ranks
from .workers import sum_pi_squared_outputs


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_tp2_sum_pi_squared_equals_full_logits(family: str) -> None:
    ranks = run_ranks(sum_pi_squared_outputs, 2, family, {"tp": 2}, 12)
    batch = make_batch(0)
    ref = reference_token_outputs(build_hf_model(model_config(family)), batch)["sum_pi_squared"]
    valid = token_valid_mask(batch["attention_mask"])
    mask = batch["loss_mask"].bool()
    for r in ranks:
        for key in ("forward", "step"):
            torch.testing.assert_close(r[key][valid], ref[valid], atol=1e-5, rtol=0)
            assert torch.all(r[key][~valid] == 0)
        assert r["metrics"]["micro_batches"] > 1
        assert r["metrics"]["spp"] == pytest.approx(float(ref[mask].sum()), abs=1e-5 * int(mask.sum()))
