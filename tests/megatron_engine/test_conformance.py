"""The megatron engine against the core's engine conformance suite (one rank)."""

import pytest
import torch
from geartrain.testing.engine_suite import EngineConformance, _batch
from geartrain.testing.reference import token_mean_nll_loss


class TestMegatronConformance(EngineConformance):
    backend = "megatron"
    overridden_tests = {
        "test_micro_batching_does_not_change_the_step": (
            "the standard test compares parameters after one AdamW step at 1e-5, which turns "
            "fp32 summation-order noise (~1e-8) in a near-zero gradient into a ~2e-5 update "
            "difference (measured: one o_proj element); here the gradients themselves are "
            "compared (1e-6), which is what micro-batching may not change"
        )
    }

    def test_micro_batching_does_not_change_the_step(self, family: str) -> None:
        big = self.make_engine(family, max_tokens_per_micro_batch=4096)
        small = self.make_engine(family, max_tokens_per_micro_batch=12)
        out_big = big.forward_backward(_batch(seed=5), token_mean_nll_loss)
        out_small = small.forward_backward(_batch(seed=5), token_mean_nll_loss)
        assert out_small.metrics["micro_batches"] > out_big.metrics["micro_batches"] == 1
        assert out_small.metrics["loss"] == pytest.approx(out_big.metrics["loss"], abs=1e-5)
        torch.testing.assert_close(out_small.outputs["log_probs"], out_big.outputs["log_probs"], atol=1e-6, rtol=0)
        grads_big = {n: p.main_grad.clone() for n, p in big.handle.modules[0].named_parameters()}
        grads_small = {n: p.main_grad.clone() for n, p in small.handle.modules[0].named_parameters()}
        for name, grad in grads_big.items():
            assert grad.abs().sum() > 0, name
            torch.testing.assert_close(grads_small[name], grad, atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
        stats_big, stats_small = big.optimizer_step(), small.optimizer_step()
        assert stats_small["grad_norm"] == pytest.approx(stats_big["grad_norm"], abs=1e-5)
