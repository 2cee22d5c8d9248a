"""KL to the reference policy: per-token estimators, the reward penalty, and the
fixed / adaptive coefficient controllers.

All tensors are ``[B, T]`` aligned like ``log_probs`` (see :mod:`geartrain.types`).
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch

from geartrain.algorithms.masked import masked_mean

KLKind = Literal["k1", "k2", "k3", "abs", "k1+", "k2+", "k3+", "abs+"]
_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "kl+": "k1+", "mse+": "k2+", "low_var_kl+": "k3+"}
KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "abs", "k1+", "k2+", "k3+", "abs+", *_ALIASES)


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: KLKind | str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi, ``d = log pi - log pi_ref``:

    * ``k1``: ``d`` (unbiased, can be negative);
    * ``k2``: ``0.5 d^2``;
    * ``k3`` (low variance, non-negative): ``exp(-d) - 1 + d`` with ``d`` clamped to
      ``±20`` and the result to ``±10`` (verl's clamps);
    * ``abs``: ``|d|``;
    * ``k1+``, ``k3+``, ``abs+`` (straight-through, verl's ``kl_penalty``): the *value* of k1 / k3 / abs
      with the *gradient* of k2 (``k2 - sg(k2) + sg(kx)``): k1 and k3 estimate the KL's
      value without bias but not its gradient, k2's gradient is the right one
      (Schulman, "Approximating KL divergence", 2020). ``k2+`` is k2 itself.

    Aliases: ``kl`` = k1, ``mse`` = k2, ``low_var_kl`` = k3 (and each with ``+``).
    Differentiable in both inputs.
    """
    kind = _ALIASES.get(kind, kind)
    if kind.endswith("+"):
        base = kind[:-1]
        if base not in ("k1", "k2", "k3", "abs"):
            raise ValueError(f"unknown KL estimator {kind!r}; choose from {', '.join(KL_KINDS)}")
        value = kl_estimate(log_probs, ref_log_probs, base)
        if base == "k2":
            return value
        grad = 0.5 * (log_probs - ref_log_probs).square()
        return grad - grad.detach() + value.detach()
    d = log_probs - ref_log_probs
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        d = torch.clamp(d, -20.0, 20.0)
        return torch.clamp(torch.exp(-d) - 1 + d, -10.0, 10.0)
    if kind == "abs":
        return d.abs()
    raise ValueError(f"unknown KL estimator {kind!r}; choose from {', '.join(KL_KINDS)}")


def apply_kl_penalty(
    token_scores: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    coef: float,
    kind: KLKind | str = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Fold the KL into the rewards: ``token_rewards = token_scores - coef * kl * mask``.

    ``log_probs`` are the rollout policy's (old) log-probs. Returns the token rewards and
    metrics ``actor/reward_kl_penalty`` (the mean over rows of each row's masked-mean KL,
    the ``current_kl`` a :class:`AdaptiveKLController` is updated with) and
    ``actor/reward_kl_penalty_coeff``.
    """
    with torch.no_grad():
        kl = kl_estimate(log_probs, ref_log_probs, kind)
        kl = torch.where(mask.bool(), kl, torch.zeros_like(kl))
        rewards = token_scores - coef * kl
        current = masked_mean(kl, mask, dim=-1).mean() if kl.shape[0] else torch.zeros(())
    return rewards, {"actor/reward_kl_penalty": float(current), "actor/reward_kl_penalty_coeff": float(coef)}


class KLController(Protocol):
    """Holds the KL coefficient ``value``; ``update`` is called once per step."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: dict[str, float]) -> None: ...


class FixedKLController:
    """A constant coefficient."""

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """The adaptive coefficient of Ziegler et al. (2019):
    ``value *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon``.

    ``n_steps`` is the number of samples (or steps, as your horizon counts them) since the
    last update.
    """

    def __init__(self, init_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target_kl > 0 and horizon > 0, got {target_kl}, {horizon}")
        self.value = float(init_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def make_kl_controller(
    kind: Literal["fixed", "adaptive"], coef: float, *, target_kl: float | None = None, horizon: int | None = None
) -> FixedKLController | AdaptiveKLController:
    """``fixed`` or ``adaptive`` (which needs ``target_kl`` and ``horizon``)."""
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("the adaptive KL controller needs target_kl and horizon")
        return AdaptiveKLController(coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; choose 'fixed' or 'adaptive'")
