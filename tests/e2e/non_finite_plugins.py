"""Extension plugins that make the policy non-finite on purpose (tests/e2e/test_non_finite.py),
and a runner that registers one and runs ``geartrain train`` in this process:

    python non_finite_plugins.py KIND CONFIG [overrides...]

Each job runs in a process of its own: an in-process vLLM that ended on an error leaves
``torch.distributed`` state behind that later jobs in the same process would trip on."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from geartrain import hookimpl, register_extension

#: below float32's largest value (3.4e38), so finite; times a normalised hidden state of
#: magnitude > 1.13 it is not, and the logits' sums meet +inf and -inf (NaN)
HUGE = 3e38


class AfterOptimizerStep:
    """Changes the engine's parameters right after each optimizer step."""

    def __init__(self, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
        self.change = change

    @hookimpl(wrapper=True)
    def optimizer_step(self, model):  # noqa: ANN001, ANN201 - the hook's own signature
        stats = yield
        with torch.no_grad():
            self.change(dict(model.hf.named_parameters()))
        return stats


class NanGradients:
    """Makes every gradient NaN after each forward/backward."""

    @hookimpl(wrapper=True)
    def forward_backward(self, model, forward_only):  # noqa: ANN001, ANN201 - the hook's own signature
        out = yield
        if not forward_only:
            for p in model.hf.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        return out


def _final_norm_huge(params: dict[str, torch.Tensor]) -> None:
    params["model.norm.weight"].fill_(HUGE)


def _nan_in(suffix: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(params: dict[str, torch.Tensor]) -> None:
        name = next(n for n in params if n.endswith(suffix))
        params[name].view(-1)[0] = float("nan")

    return change


KINDS: dict[str, object] = {
    "nan_gradients": NanGradients(),
    "huge_final_norm": AfterOptimizerStep(_final_norm_huge),
    "nan_weight": AfterOptimizerStep(_nan_in("mlp.up_proj.weight")),
    "nan_adapter": AfterOptimizerStep(_nan_in("q_proj.lora_B.default.weight")),
}


if __name__ == "__main__":
    kind, config, *overrides = sys.argv[1:]
    register_extension("issue39", KINDS[kind], distribution="tests", version="0")
    from geartrain.cli import main

    sys.exit(main(["train", config, *overrides, 'actor.engine.extensions=["issue39"]']))
