"""geartrain.optim: the LR schedule's formula, which lr a step reports, clipping and the
non-finite skip, against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from geartrain.config import OptimConfig
from geartrain.optim import build_optimizer, clipped_step, lr_factor


def test_schedules_follow_the_documented_formula() -> None:
    cos = OptimConfig(lr=1.0, lr_schedule="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    # warmup (s+1)/W, then r + (1-r)(1+cos(pi p))/2 with p = (s-W)/(N-W), flat at r from s = N
    assert [lr_factor(s, cos) for s in range(8)] == pytest.approx(
        [
            0.5,
            1.0,
            1.0,
            0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2,
            0.55,
            0.1 + 0.9 * (1 + math.cos(3 * math.pi / 4)) / 2,
            0.1,
            0.1,
        ]
    )
    lin = OptimConfig(lr=1.0, lr_schedule="linear", total_steps=4, min_lr_ratio=0.2)
    assert [lr_factor(s, lin) for s in range(6)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.2])
    const = OptimConfig(lr=1.0, warmup_steps=4)
    assert [lr_factor(s, const) for s in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def _param(values: list[float]) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.tensor(values))


def test_the_reported_lr_is_the_one_this_step_used() -> None:
    p = _param([1.0, -2.0])
    cfg = OptimConfig(lr=0.1, weight_decay=0.0, warmup_steps=2, lr_schedule="linear", total_steps=4)
    opt, sched = build_optimizer([p], cfg)
    reported, moved = [], []
    for _ in range(4):
        before = p.detach().clone()
        p.grad = torch.tensor([0.5, -0.25])
        reported.append(clipped_step([p], opt, sched, clip=1.0).lr)
        moved.append(float((before - p.detach())[0]))
    assert reported == pytest.approx([0.05, 0.1, 0.1, 0.05])
    # AdamW's first update is lr * g / (|g| + eps): exactly the reported lr per element
    assert moved[0] == pytest.approx(0.05, rel=1e-6)


def test_clip_zero_measures_without_clipping() -> None:
    for clip, expected in ((1.0, [0.6, 0.8]), (0.0, [3.0, 4.0]), (10.0, [3.0, 4.0])):
        p = _param([0.0, 0.0])
        opt, sched = build_optimizer([p], OptimConfig(lr=0.1, weight_decay=0.0))
        p.grad = torch.tensor([3.0, 4.0])
        result = clipped_step([p], opt, sched, clip=clip)
        assert result.grad_norm == pytest.approx(5.0) and not result.skipped
        # AdamW's first moment after one step is (1 - beta1) * the gradient it was given
        torch.testing.assert_close(opt.state[p]["exp_avg"], 0.1 * torch.tensor(expected))
        assert p.grad is None


def test_a_non_finite_norm_skips_the_update_and_the_schedule() -> None:
    p = _param([1.0, 2.0])
    opt, sched = build_optimizer([p], OptimConfig(lr=0.1, warmup_steps=4))
    p.grad = torch.tensor([float("nan"), 1.0])
    bad = clipped_step([p], opt, sched, clip=1.0)
    assert bad.skipped and not math.isfinite(bad.grad_norm)
    assert bad.metrics() == {"grad_norm": bad.grad_norm, "lr": pytest.approx(0.025), "skipped": 1.0}
    torch.testing.assert_close(p.detach(), torch.tensor([1.0, 2.0]), rtol=0, atol=0)
    assert p.grad is None and not opt.state
    p.grad = torch.tensor([1.0, 1.0])
    good = clipped_step([p], opt, sched, clip=1.0)
    assert not good.skipped and good.lr == pytest.approx(0.025), "a skipped step must not advance the schedule"


def test_a_decaying_schedule_without_total_steps_is_refused() -> None:
    cfg = OptimConfig(lr=1.0)
    object.__setattr__(cfg, "lr_schedule", "cosine")  # bypass the config check: the function checks too
    with pytest.raises(ValueError, match="total_steps"):
        lr_factor(0, cfg)


def test_adamw_is_fused_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 33 item 6: every parameter on CUDA -> AdamW(fused=True); a CPU (or a mix, as
    under CPU offload) keeps torch's default implementation."""
    from geartrain.optim import fused_adamw

    assert fused_adamw({"cuda"}) and not fused_adamw({"cpu"}) and not fused_adamw({"cuda", "cpu"})
    seen: list[object] = []
    real = torch.optim.AdamW

    def spy(params: object, **kwargs: object) -> torch.optim.Optimizer:
        seen.append(kwargs.get("fused"))
        return real(params, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", spy)
    build_optimizer([torch.nn.Parameter(torch.zeros(3))], OptimConfig(lr=0.1))
    monkeypatch.setattr("geartrain.optim.fused_adamw", lambda types: True)  # as on a GPU machine
    build_optimizer([torch.nn.Parameter(torch.zeros(3))], OptimConfig(lr=0.1))  # fused CPU AdamW exists too
    assert seen == [None, True]


def test_a_resume_with_a_longer_horizon_trains_its_next_step_at_the_new_schedules_rate() -> None:
    """Issue 35, round 14: after ``--resume`` with a larger ``trainer.total_steps`` (the LR
    horizon "applied"), the first step trained at the old schedule's rate (its end: the
    minimum, from the optimizer's restored state) and only later steps at the new one's; an
    uninterrupted run of the new length differed there."""
    from geartrain.optim import load_scheduler_state

    def run(total: int, steps: int) -> tuple[torch.nn.Parameter, torch.optim.Optimizer, object]:
        param = torch.nn.Parameter(torch.ones(2))
        cfg = OptimConfig(lr=1e-2, lr_schedule="linear", total_steps=total, min_lr_ratio=0.1)
        optimizer, scheduler = build_optimizer([param], cfg)
        for _ in range(steps):
            param.grad = torch.ones(2)
            clipped_step([param], optimizer, scheduler, clip=0.0)
        return param, optimizer, scheduler

    _, old_optimizer, old_scheduler = run(total=4, steps=4)
    _, fresh_optimizer, _ = run(total=8, steps=4)  # the new length, uninterrupted
    param, optimizer, scheduler = run(total=8, steps=0)  # the resumed engine: the new horizon
    optimizer.load_state_dict(old_optimizer.state_dict())
    load_scheduler_state(scheduler, old_scheduler.state_dict())
    assert optimizer.param_groups[0]["lr"] == fresh_optimizer.param_groups[0]["lr"]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(
        1e-2 * lr_factor(4, OptimConfig(lr=1e-2, lr_schedule="linear", total_steps=8, min_lr_ratio=0.1))
    )
    assert scheduler.get_last_lr() == [optimizer.param_groups[0]["lr"]]
