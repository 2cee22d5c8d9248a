"""Bounds the config schema puts on floats, so that every accepted value is one a run can use."""

from __future__ import annotations

#: The longest time any ``*timeout_s`` setting may name (about 115 days): longer ones are
#: "no limit" (``None`` where a setting takes it) and overflow the clocks they are waited on.
MAX_TIMEOUT_S = 1e7

#: The largest magnitude of a loss coefficient or reward weight: beyond it a step's loss or
#: reward is no longer a usable float.
MAX_COEF = 1e6

#: The largest seed: every seed (``trainer.seed``, ``model.seed``, ``data.seed``, ``sft.seed``)
#: is in ``[0, MAX_SEED]``, the range torch's generators and numpy's seed sequences both take
#: (a negative seed, or one past 2**64, fails inside them at the first step).
MAX_SEED = 2**63 - 1
