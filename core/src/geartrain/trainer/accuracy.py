"""What "accuracy" is in a run: ``train_acc`` and ``reward/accuracy``, ``val/accuracy``, the
printed "accuracy before/after", the curves and ``sft.stop_at_accuracy`` all read it.

``reward.accuracy`` declares it:

* unset: the ``acc`` a reward function returns with its score (``{"score": s, "acc": 1.0}``),
  else ``reward > 0``. The second is right for a 0/1 reward only: the first time a batch's
  rewards are not all 0 or 1 it is said, once, on the console (a format reward that gives
  0.5 to every well-formed answer would read as 100 % accurate).
* a name: a numeric key reward functions return (``"correct"``; with several functions
  ``"<name>/<key>"``), or the name of a ``[[reward.functions]]`` entry (its score > 0: an
  exact-match function with ``weight = 0`` counts answers without changing the reward).
* ``file.py:function`` or ``package.module:function``: a function called as reward
  functions are (per sample or batched, TRL's keywords included) whose value > 0 (or whose
  ``acc``) is a correct sample.
"""

from __future__ import annotations

import logging
from typing import Any

from geartrain.batch import Batch
from geartrain.errors import GeartrainError
from geartrain.rewards import RewardResult, correctness, make_term
from geartrain.user_code import is_file_spec, load_from_file

logger = logging.getLogger(__name__)

#: The runs (by output directory) told that their accuracy is read as reward > 0: once per
#: run, though the warm start's dev scoring and the RL steps each hold an :class:`Accuracy`.
_TOLD: set[str] = set()


def accuracy_of(config: Any) -> Accuracy:
    """The :class:`Accuracy` a :class:`~geartrain.trainer.config.TrainConfig` declares."""
    return Accuracy(
        config.reward.accuracy,
        run=str(config.trainer.output_dir),
        base_dir=config.base_dir,
        timeout_s=config.reward.timeout_s,
        truth_column=config.data.ground_truth_key,
    )


class Accuracy:
    """``reward.accuracy`` resolved: call it with a batch's reward result and the batch for
    each sample's 1.0 / 0.0. Raises :class:`GeartrainError` at construction when the
    function cannot be resolved, and on a batch whose results lack the declared key."""

    def __init__(
        self,
        spec: str | None,
        *,
        run: str = "",
        base_dir: str | None = None,
        timeout_s: float | None = None,
        truth_column: str = "ground_truth",
    ) -> None:
        self.spec = spec
        self.key: str | None = None
        self.worker: Any | None = None
        self.run = run
        if spec is None:
            return
        if ":" not in spec:
            self.key = spec
            return
        from geartrain.trainer.roles import RewardWorker

        fn: Any = spec
        if is_file_spec(spec):
            fn = load_from_file(spec, base_dir, what="accuracy function", key="reward.accuracy")
            if not callable(fn):
                raise GeartrainError(f"accuracy function '{spec}' is not callable ({type(fn).__name__})")
        term = make_term(fn, name="accuracy", truth_column=truth_column)
        self.worker = RewardWorker([term], None, None, timeout_s=timeout_s, ctx=None)  # type: ignore[arg-type]

    def __call__(self, result: RewardResult, batch: Batch) -> list[float]:
        """Each sample's accuracy (1.0 or 0.0) in ``batch``, scored as ``result``."""
        if self.worker is not None:
            return correctness(RewardResult.from_rows(self.worker.score(batch)))
        if self.key is not None:
            return self._by_key(result)
        values = correctness(result)
        acc = result.extras.get("acc", [None] * len(values))
        inferred = [s for a, s in zip(acc, result.scores.tolist(), strict=True) if a is None]
        odd = next((s for s in inferred if s not in (0.0, 1.0)), None)
        if odd is not None and self.run not in _TOLD:
            _TOLD.add(self.run)
            logger.warning(
                "accuracy is read as reward > 0: the reward function returns no 'acc' and its rewards are not 0/1 "
                "(e.g. %.4g), so train_acc, val/accuracy, the accuracy before/after and sft.stop_at_accuracy count "
                "every positive reward as correct; set reward.accuracy to what a correct answer is "
                "(a key, a [[reward.functions]] name or a function: docs/rewards.md#accuracy)",
                odd,
            )
        return values

    def _by_key(self, result: RewardResult) -> list[float]:
        key = self.key
        assert key is not None
        if key in result.extras:
            return [float(v is not None and v > 0) for v in result.extras[key]]
        if key in result.term_scores:
            return [float(v is not None and v > 0) for v in result.term_scores[key]]
        keys = sorted(result.extras) or ["none"]
        raise GeartrainError(
            f"reward.accuracy = '{key}': no reward function returned it; the keys returned are: {', '.join(keys)}; "
            f"the functions are: {', '.join(result.term_scores) or 'none'}"
        )
