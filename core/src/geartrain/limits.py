"""Bounds the config schema puts on floats, so that every accepted value is one a run can use."""

from __future__ import annotations

#: The longest time any ``*timeout_s`` setting may name (about 115 days): longer ones are
#: "no limit" (``None`` where a setting takes it) and overflow the clocks they are waited on.
MAX_TIMEOUT_S = 1e7

#: The largest magnitude of a loss coefficient or reward weight: beyond it a step's loss or
#: reward is no longer a usable float.
MAX_COEF = 1e6
