"""Watchdogs: a run that trains nothing says so, and stops when it cannot recover.

After every RL step :meth:`Watchdog.observe` reads the step's metrics and counts
consecutive steps in which

* every optimizer step was skipped because the gradient was not finite (``actor/skipped``)
  — ``max_skipped_steps`` of them stop the run with an error;
* every advantage was zero, so the policy gradient was zero (``advantages/abs_mean``) —
  ``zero_advantage_steps`` of them warn once per streak, naming the likely cause (identical
  samples in each group, or a constant reward);
* every reward call failed or timed out (``reward/error_fraction``) — each such step warns,
  ``max_failed_reward_steps`` of them stop the run;
* every multi-turn episode ended with an environment error (``agent/env_error_fraction``:
  ``reset`` or ``step`` raised or returned a bad result) — each such step warns,
  ``max_failed_episode_steps`` of them stop the run.

Scores that are not finite or too large for the loss's float32 arithmetic
(``reward/max_abs``, see :data:`HUGE_REWARD`) are named as such, once, and in place of the
learning-rate advice when they are what made the steps skip.

A policy whose weights, or the logits they produce, are not finite
(:class:`~geartrain.errors.NonFiniteError`: a weight sync refused to publish them, or a
rollout sampled from NaN logits) cannot go on at all: :func:`non_finite_stop` turns it into
the stop of the step it happened in.

A run shorter than a streak's limit is judged at its end (:meth:`Watchdog.finish`): if
every one of its steps skipped its optimizer step, or every one's reward calls failed, it
trained nothing, and it ends with the same error instead of exit 0.

The stops raise :class:`TrainingStalledError` (a :class:`geartrain.GeartrainError`:
``geartrain train`` prints it and exits 2); the checkpoints saved so far stay.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import Field

from geartrain.config import Section
from geartrain.errors import GeartrainError, NonFiniteError

logger = logging.getLogger("geartrain.watchdog")


class WatchdogConfig(Section):
    """When a run that is not training stops or warns (0 turns a watchdog off)."""

    max_skipped_steps: int = Field(3, ge=0)
    """Stop after this many consecutive steps whose optimizer steps were all skipped (non-finite gradient)."""
    zero_advantage_steps: int = Field(5, ge=0)
    """Warn after this many consecutive steps whose advantages were all zero (no learning signal)."""
    max_failed_reward_steps: int = Field(3, ge=0)
    """Stop after this many consecutive steps whose reward calls all failed or timed out."""
    max_failed_episode_steps: int = Field(3, ge=0)
    """Stop after this many consecutive steps whose episodes all ended with an environment error."""


#: a score's magnitude beyond which float32 statistics of a batch (its variance: the square)
#: overflow, so advantages and gradients become inf/nan whatever the learning rate
HUGE_REWARD = 1e18


def _reward_problem(metrics: dict[str, Any]) -> str | None:
    """What is wrong with the step's scores (``None``: nothing)."""
    value = metrics.get("reward/max_abs")
    if value is None:
        return None
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        return (
            f"the reward scores are not finite (reward/max_abs = {value}; a score beyond float32's range, "
            "e.g. 1e300, becomes inf)"
        )
    if value > HUGE_REWARD:
        return f"the reward scores are too large (reward/max_abs = {value:.3g}; their float32 variance overflows)"
    return None


class TrainingStalledError(GeartrainError):
    """A watchdog stopped the run: it was not training."""


def non_finite_stop(exc: NonFiniteError, step: int, checkpoint: int | None) -> TrainingStalledError:
    """The stop for a policy that is not finite, found during ``step`` (0: before the first
    RL step), with the newest complete checkpoint (``None``: none) named as kept."""
    kept = f"the newest checkpoint (step {checkpoint}) is kept" if checkpoint is not None else "no checkpoint was saved"
    if step == 0:  # before the first update of a fresh run: what it started from holds them
        return TrainingStalledError(
            f"step 0: {exc}. No update has run yet: the model the run starts from holds such weights (model.path; "
            "or the SFT warm start's <output_dir>/sft_model: lower sft.optim.lr); check or replace it. "
            f"The run stopped here; {kept}"
        )
    return TrainingStalledError(
        f"step {step}: {exc}. After an update this means the learning rate is too high: lower "
        "actor.engine.optim.lr; after --resume, the checkpoint holds such "
        f"weights: resume from an earlier one. The run stopped here; {kept}"
    )


class Watchdog:
    """Counts the streaks described in the module docstring over the steps of one run."""

    def __init__(self, config: WatchdogConfig, *, temperature: float | None = None, n: int | None = None) -> None:
        self.config = config
        self.temperature = temperature
        self.n = n
        self.skipped = 0
        self.zero_advantage = 0
        self.failed_rewards = 0
        self.failed_episodes = 0
        self.bad_rewards_said = False
        self.observed = 0
        self.last: tuple[int, dict[str, Any]] | None = None

    def observe(self, step: int, metrics: dict[str, Any]) -> None:
        """Update the streaks with ``step``'s metrics; warn or raise
        :class:`TrainingStalledError` as configured."""
        self.observed += 1
        self.last = (step, metrics)
        self._scale(step, metrics)
        self._skipped(step, metrics)
        self._rewards(step, metrics)
        self._episodes(step, metrics)
        self._advantages(step, metrics)

    def _skipped(self, step: int, metrics: dict[str, Any]) -> None:
        skipped = metrics.get("actor/skipped")
        if skipped is None:  # no actor update this step (critic warm-up)
            return
        self.skipped = self.skipped + 1 if float(skipped) >= 1.0 else 0
        k = self.config.max_skipped_steps
        if k and self.skipped >= k:
            raise self._skipped_stop(step, metrics, f"the last {self.skipped} steps")

    def _skipped_stop(self, step: int, metrics: dict[str, Any], which: str) -> TrainingStalledError:
        k = self.config.max_skipped_steps
        if (problem := _reward_problem(metrics)) is not None:
            return TrainingStalledError(
                f"step {step}: {which} skipped every optimizer step because the gradient was "
                f"not finite, and {problem}: fix the reward function to return finite scores of a sensible scale "
                f"(the learning rate is not the cause; watchdog.max_skipped_steps, now {k}, lets the run go on)"
            )
        return TrainingStalledError(
            f"step {step}: {which} skipped every optimizer step because the gradient "
            f"was not finite (actor/grad_norm = {metrics.get('actor/grad_norm')}, lr = {metrics.get('actor/lr')}); "
            "the learning rate is likely too high or the loss overflows. Lower actor.engine.optim.lr "
            f"(or raise watchdog.max_skipped_steps, now {k}, to let the run go on)"
        )

    def finish(self) -> None:
        """The run's last step is done: raise :class:`TrainingStalledError` if every step it
        ran (fewer than a streak's limit, or the streak would have stopped it) skipped its
        optimizer step, had every reward call fail, or had every episode end with an
        environment error: such a run trained nothing, which must not end as a success. A
        watchdog turned off (0) stays off."""
        if self.last is None:
            return
        step, metrics = self.last
        if self.config.max_skipped_steps and self.skipped == self.observed:
            raise self._skipped_stop(step, metrics, f"all {self.observed} steps of this run (nothing was trained)")
        if self.config.max_failed_reward_steps and self.failed_rewards == self.observed:
            raise TrainingStalledError(
                f"step {step}: every reward call of all {self.observed} steps of this run failed or timed out, so "
                "every sample scored 0 and nothing was learned; fix the reward function (its first traceback is "
                "logged above) or raise reward.timeout_s"
            )
        if self.config.max_failed_episode_steps and self.failed_episodes == self.observed:
            raise TrainingStalledError(
                f"step {step}: every episode of all {self.observed} steps of this run ended with an environment "
                "error, so nothing was learned; fix the environment (its first failure is logged above, by the rank "
                "that ran it)"
            )

    def _scale(self, step: int, metrics: dict[str, Any]) -> None:
        problem = _reward_problem(metrics)
        if problem is not None and not self.bad_rewards_said:
            self.bad_rewards_said = True
            logger.warning(
                "step %d: %s; the advantages and the gradient will not be finite. Fix the reward function "
                "(this is said once)",
                step,
                problem,
            )

    def _rewards(self, step: int, metrics: dict[str, Any]) -> None:
        fraction = metrics.get("reward/error_fraction")
        if fraction is None:
            return
        if float(fraction) < 1.0:
            self.failed_rewards = 0
            return
        self.failed_rewards += 1
        k = self.config.max_failed_reward_steps
        what = (
            f"every reward call of step {step} failed or timed out ({int(metrics.get('reward/errors', 0))} errors, "
            f"{int(metrics.get('reward/timeouts', 0))} timeouts): all its samples scored 0"
        )
        if k and self.failed_rewards >= k:
            raise TrainingStalledError(
                f"{what}, for {self.failed_rewards} steps in a row; fix the reward function (its first traceback is "
                f"logged above) or raise reward.timeout_s (or watchdog.max_failed_reward_steps, now {k})"
            )
        logger.warning("%s (the run stops after %s such steps in a row)", what, k or "no")

    def _episodes(self, step: int, metrics: dict[str, Any]) -> None:
        fraction = metrics.get("agent/env_error_fraction")
        if fraction is None:
            return
        if float(fraction) < 1.0:
            self.failed_episodes = 0
            return
        self.failed_episodes += 1
        k = self.config.max_failed_episode_steps
        what = (
            f"every episode of step {step} ended with an environment error ({int(metrics.get('agent/env_errors', 0))} "
            "episodes): the environment's reset or step raised or returned a bad result"
        )
        if k and self.failed_episodes >= k:
            raise TrainingStalledError(
                f"{what}, for {self.failed_episodes} steps in a row; fix the environment (its first failure is logged "
                f"above, by the rank that ran it) or raise watchdog.max_failed_episode_steps (now {k})"
            )
        logger.warning("%s (the run stops after %s such steps in a row)", what, k or "no")

    def _advantages(self, step: int, metrics: dict[str, Any]) -> None:
        value = metrics.get("advantages/abs_mean")
        if value is None:
            return
        if float(value) != 0.0:
            self.zero_advantage = 0
            return
        self.zero_advantage += 1
        k = self.config.zero_advantage_steps
        if not k or self.zero_advantage != k:
            return  # once per streak
        if float(metrics.get("reward/std", 1.0)) == 0.0:
            cause = (
                f"every sample got the same reward ({metrics.get('reward/mean')}): "
                "the reward is constant on these prompts"
            )
        else:
            cause = "the samples of each group got identical rewards"
        if self.temperature == 0.0:
            cause += f"; sampling.temperature = 0 makes the {self.n} samples of a prompt identical"
        elif self.n == 1:
            cause += "; sampling.n = 1 leaves a group-relative advantage nothing to compare"
        logger.warning(
            "the advantages were all zero for the last %d steps (through step %d), so the policy gradient is zero and "
            "nothing is learned: %s",
            self.zero_advantage,
            step,
            cause,
        )
