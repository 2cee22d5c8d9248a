"""The fused linear log-prob / entropy head (issue 33 item 5,
:class:`geartrain_fsdp.logprobs.LinearLogProbs`): the checkpointed path's numbers and
gradients, with one recomputation of each chunk's logits and no autograd graph over them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from geartrain_fsdp import logprobs
from geartrain_fsdp.logprobs import token_log_probs
from torch.utils._python_dispatch import TorchDispatchMode

from .common import make_batch, make_engine, token_mean_loss

N, H, V, CHUNK = 70, 24, 997, 16


def _run(fused: bool, dtype: torch.dtype, need_entropy: bool, train_weight: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(N, H, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) / 4).to(dtype).requires_grad_(train_weight)
    targets = torch.randint(0, V, (N,), generator=gen)
    g_lp, g_ent = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    got = token_log_probs(
        hidden, weight, targets, chunk_tokens=CHUNK, need_entropy=need_entropy, need_sum_pi_squared=True, fused=fused
    )
    lp, ent = got["log_probs"], got.get("entropy")
    assert not got["sum_pi_squared"].requires_grad
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if ent is not None else 0)
    loss.backward()
    out = [lp.detach(), hidden.grad, got["sum_pi_squared"]]
    if ent is not None:
        out.append(ent.detach())
    if train_weight:
        out.append(weight.grad)
    return out


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("need_entropy", [True, False])
@pytest.mark.parametrize("train_weight", [True, False], ids=["weight", "frozen_weight"])
def test_fused_head_equals_the_checkpointed_chunks(
    dtype: torch.dtype, tol: float, need_entropy: bool, train_weight: bool
) -> None:
    fused = _run(True, dtype, need_entropy, train_weight)
    reference = _run(False, dtype, need_entropy, train_weight)
    for a, b in zip(fused, reference, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        scale = max(1.0, float(b.float().abs().max()))
        err = float((a.float() - b.float()).abs().max()) / scale
        assert err < tol, (a.dtype, a.shape, err)


class _FullSizeOps(TorchDispatchMode):
    """The non-view aten ops that produce a ``[CHUNK, V]`` tensor."""

    VIEWS = frozenset({"t", "detach", "expand", "view", "_unsafe_view", "slice", "alias"})

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if isinstance(out, torch.Tensor) and out.numel() == CHUNK * V and name not in self.VIEWS:
            self.ops.append(name)
        return out


def _backward_ops(fused: bool) -> list[str]:
    hidden = torch.randn(CHUNK, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    out = token_log_probs(
        hidden, weight, torch.zeros(CHUNK, dtype=torch.long), chunk_tokens=CHUNK, need_entropy=True, fused=fused
    )
    lp, ent = out["log_probs"], out["entropy"]
    with _FullSizeOps() as mode:
        (lp.sum() + ent.sum()).backward()
    return mode.ops


def test_backward_recomputes_the_logits_once_without_autograd_over_them() -> None:
    fused, checkpointed = _backward_ops(True), _backward_ops(False)
    assert fused.count("mm") == 1 and fused.count("_softmax") == 1  # one recomputation
    assert "_softmax_backward_data" in checkpointed and "_softmax_backward_data" not in fused
    assert "exp" not in fused  # no log-softmax backward
    assert len(fused) < len(checkpointed), (fused, checkpointed)


def test_engine_trains_through_the_fused_head(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = logprobs.LinearLogProbs.apply
    monkeypatch.setattr(logprobs.LinearLogProbs, "apply", lambda *a: calls.append(1) or real(*a))
    batch = make_batch(3, rows=4)
    batch.info["need_entropy"] = True
    fused = make_engine(options={"logits_chunk_tokens": 7})
    out = fused.forward_backward(batch, token_mean_loss)
    assert calls  # the default engine trains through it
    grads = {n: p.grad.clone() for n, p in fused.handle.module.named_parameters() if p.grad is not None}
    calls.clear()
    plain = make_engine(options={"logits_chunk_tokens": 7, "fused_log_probs": False})
    ref = plain.forward_backward(batch, token_mean_loss)
    assert not calls
    assert torch.allclose(out.outputs["log_probs"], ref.outputs["log_probs"], atol=1e-6)
    for name, p in plain.handle.module.named_parameters():
        if p.grad is not None:
            assert torch.allclose(grads[name], p.grad, atol=1e-6, rtol=1e-5), name
