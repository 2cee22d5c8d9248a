"""What a decode loop of the torch rollout has produced, row by row (shared by the dynamic
loop in :mod:`~geartrain.rollouts.torch_rollout` and the static-cache one in
:mod:`~geartrain.rollouts.static_decode`): each row's tokens and their log-probs, its length,
and whether it stopped, with the stop rules of ``SamplingParams`` applied in one place."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["DecodeRecord"]


class DecodeRecord:
    """``rows`` rows of at most ``max(budgets)`` tokens each. Call :meth:`add` once per step
    ``t`` with the rows still generating; :meth:`results` gives ``(tokens, log_probs,
    finish_reason)`` per row in the original order."""

    def __init__(self, budgets: Sequence[int], stop_token_ids: Sequence[int], stop_sequences: Sequence[Sequence[int]],
                 device: torch.device) -> None:
        rows, steps = len(budgets), max(budgets)
        self.steps = steps
        self.tokens = torch.zeros((rows, steps), dtype=torch.long)
        self.token_lps = torch.zeros((rows, steps), dtype=torch.float32)
        self.lengths = torch.zeros(rows, dtype=torch.long)
        self.stopped = torch.zeros(rows, dtype=torch.bool)
        self.limits = torch.tensor(list(budgets), dtype=torch.long)
        self.stop = torch.tensor(sorted(set(stop_token_ids)) or [-1], device=device)
        self.stop_seqs = [torch.tensor(list(seq), dtype=torch.long) for seq in stop_sequences]

    def add(self, active: torch.Tensor, t: int, new: torch.Tensor, new_lp: torch.Tensor) -> torch.Tensor:
        """Record step ``t``'s token ``new`` (and its log-prob) of each row in ``active``
        (original row indices); returns which of them go on (not stopped, budget left)."""
        is_stop = torch.isin(new, self.stop).cpu()
        self.tokens[active, t] = new.cpu()
        # Every row started at column 0 of this call, so its last len(seq) tokens are
        # columns t+1-len(seq) .. t: only tokens of this call are ever matched.
        for seq in self.stop_seqs:
            if len(seq) <= t + 1:
                is_stop |= (self.tokens[active, t + 1 - len(seq) : t + 1] == seq).all(-1)
        self.token_lps[active, t] = new_lp.cpu()
        self.lengths[active] = t + 1
        self.stopped[active] = is_stop
        return ~is_stop & (t + 1 < self.limits[active])

    def results(self) -> list[tuple[list[int], list[float], str]]:
        lengths = self.lengths.tolist()
        tokens = [row[:n] for row, n in zip(self.tokens.tolist(), lengths, strict=True)]
        lps = [row[:n] for row, n in zip(self.token_lps.tolist(), lengths, strict=True)]
        reasons = ["stop" if s else "length" for s in self.stopped.tolist()]
        return list(zip(tokens, lps, reasons, strict=True))
