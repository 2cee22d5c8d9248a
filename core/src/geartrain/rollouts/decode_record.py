"""The pieces both decode loops of the torch rollout share (the dynamic loop in
:mod:`~geartrain.rollouts.torch_rollout` and the static-cache one in
:mod:`~geartrain.rollouts.static_decode`): the prefill input, one left-padded row per
distinct prompt (:func:`prefill_rows`), and what the loop has produced row by row, each
row's tokens and their log-probs, its length and whether it stopped, with the stop rules of
``SamplingParams`` applied in one place: :class:`DecodeRecord` for the dynamic loop (host
tensors, the live rows of each step), :class:`DeviceDecodeRecord` for the static one (device
tensors of fixed shape, every row every step, nothing read back until the end)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["DecodeRecord", "DeviceDecodeRecord", "PrefillRows", "last_logits_only", "prefill_rows"]


class PrefillRows(NamedTuple):
    unique: list[int]
    """The first row of each distinct prompt, in order: the rows the prefill runs."""
    expand: torch.Tensor
    """For each row, the index of its prompt in ``unique`` (to go from one row per prompt
    to one row per sample after the prefill)."""
    input_ids: torch.Tensor
    """``[len(unique), width]`` left-padded prompt ids, on the device."""
    mask: torch.Tensor
    """``[len(unique), width]`` attention mask, on the device."""
    positions: torch.Tensor
    """``[len(unique), width]`` position ids counted over real tokens, on the device."""


def prefill_rows(
    prompts: Sequence[Sequence[int]], keys: Sequence[int], pad_token_id: int, device: torch.device
) -> PrefillRows:
    """One left-padded row per distinct prompt key (rows with the same key share a prompt:
    the samples of one prompt are prefilled once)."""
    first_row: dict[int, int] = {}
    for r, key in enumerate(keys):
        first_row.setdefault(key, r)
    unique = list(first_row.values())
    slot = {key: u for u, key in enumerate(first_row)}
    expand = torch.tensor([slot[key] for key in keys], device=device)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(unique), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(unique), width), dtype=torch.long)
    for u, r in enumerate(unique):
        p = prompts[r]
        input_ids[u, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[u, width - len(p) :] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    return PrefillRows(unique, expand, input_ids, mask, (mask.cumsum(-1) - 1).clamp_min(0))


def last_logits_only(model: torch.nn.Module) -> dict[str, Any]:
    """Forward keyword arguments that make ``model`` compute the logits of the last position
    only (``logits_to_keep=1``, where its forward takes it): a prefill needs one row of
    logits per prompt, not ``prompt length x vocabulary`` (5 GB in bf16 for 64 prompts of
    256 tokens over a 152k vocabulary)."""
    accepts = "logits_to_keep" in inspect.signature(model.forward).parameters
    return {"logits_to_keep": 1} if accepts else {}


class DecodeRecord:
    """``rows`` rows of at most ``max(budgets)`` tokens each. Call :meth:`add` once per step
    ``t`` with the rows still generating; :meth:`results` gives ``(tokens, log_probs,
    finish_reason)`` per row in the original order."""

    def __init__(
        self,
        budgets: Sequence[int],
        stop_token_ids: Sequence[int],
        stop_sequences: Sequence[Sequence[int]],
        device: torch.device,
    ) -> None:
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
        return _rows(self.tokens, self.token_lps, self.lengths, self.stopped)


class DeviceDecodeRecord:
    """What :class:`DecodeRecord` records, kept on the device in buffers of fixed shape, for
    the static-cache decode: :meth:`add` takes every row at every step and the step index
    as a 0-d device tensor, and never reads a value back to the host, so a decode step that
    calls it can be captured in a CUDA graph. Rows that finished keep being fed (their
    tokens are ignored): :attr:`done` says which. :meth:`results` reads everything back
    once, in :class:`DecodeRecord`'s format."""

    def __init__(
        self,
        budgets: Sequence[int],
        stop_token_ids: Sequence[int],
        stop_sequences: Sequence[Sequence[int]],
        device: torch.device,
    ) -> None:
        rows, steps = len(budgets), max(budgets)
        self.steps = steps
        self.tokens = torch.zeros((rows, steps), dtype=torch.long, device=device)
        self.token_lps = torch.zeros((rows, steps), dtype=torch.float32, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.stopped = torch.zeros(rows, dtype=torch.bool, device=device)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.limits = torch.tensor(list(budgets), dtype=torch.long, device=device)
        self.stop = torch.tensor(sorted(set(stop_token_ids)) or [-1], dtype=torch.long, device=device)
        self.stop_seqs = [torch.tensor(list(seq), dtype=torch.long, device=device) for seq in stop_sequences]
        # each row's last tokens of this call, newest last; -1 (no token id) before its first,
        # so a stop sequence longer than what a row generated cannot match
        self.recent = torch.full(
            (rows, max((len(q) for q in stop_sequences), default=0)), -1, dtype=torch.long, device=device
        )

    def add(self, t: torch.Tensor, new: torch.Tensor, new_lp: torch.Tensor) -> None:
        """Record step ``t``'s token ``new`` ``[rows]`` and its log-prob for the rows not
        yet done; rows stop on a stop token, a stop sequence or their budget."""
        live = ~self.done
        column = t.view(1, 1).expand(len(new), 1)
        self.tokens.scatter_(1, column, new.unsqueeze(1))  # a done row's columns past its length are never read
        self.token_lps.scatter_(1, column, new_lp.unsqueeze(1))
        is_stop = (new.unsqueeze(1) == self.stop).any(1)
        if self.recent.shape[1]:
            self.recent.copy_(torch.cat([self.recent[:, 1:], new.unsqueeze(1)], dim=1))
            for seq in self.stop_seqs:
                is_stop |= (self.recent[:, self.recent.shape[1] - len(seq) :] == seq).all(1)
        self.lengths.copy_(torch.where(live, t + 1, self.lengths))
        self.stopped |= live & is_stop
        self.done |= is_stop | (t + 1 >= self.limits)

    def results(self) -> list[tuple[list[int], list[float], str]]:
        return _rows(self.tokens, self.token_lps, self.lengths, self.stopped)

    #: The buffers with one entry per row.
    ROW_BUFFERS = ("tokens", "token_lps", "lengths", "stopped", "done", "limits", "recent")

    def select(self, index: torch.Tensor) -> DeviceDecodeRecord:
        """A record of the rows ``index`` (a device index tensor) only, in that order: every
        per-row buffer's rows picked, the same stop rules (the compaction of finished rows)."""
        new = object.__new__(DeviceDecodeRecord)
        new.steps, new.stop, new.stop_seqs = self.steps, self.stop, self.stop_seqs
        for name in self.ROW_BUFFERS:
            setattr(new, name, getattr(self, name).index_select(0, index))
        return new

    def results_of(self, index: torch.Tensor) -> list[tuple[list[int], list[float], str]]:
        """:meth:`results` of the rows ``index`` only."""
        return _rows(*(getattr(self, n).index_select(0, index) for n in ("tokens", "token_lps", "lengths", "stopped")))


def _rows(
    tokens: torch.Tensor, token_lps: torch.Tensor, lengths: torch.Tensor, stopped: torch.Tensor
) -> list[tuple[list[int], list[float], str]]:
    """``(tokens, log_probs, finish_reason)`` per row, each row cut at its length."""
    n = lengths.tolist()
    rows = [row[:k] for row, k in zip(tokens.tolist(), n, strict=True)]
    lps = [row[:k] for row, k in zip(token_lps.tolist(), n, strict=True)]
    reasons = ["stop" if s else "length" for s in stopped.tolist()]
    return list(zip(rows, lps, reasons, strict=True))
