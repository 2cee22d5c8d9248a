"""A stateful, deterministic prompt loader whose position is part of a checkpoint."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from geartrain.data.dataset import PromptDataset, PromptRow
from geartrain.errors import DataError


@dataclass(kw_only=True, slots=True)
class PromptBatch:
    """The prompts of one step, in order."""

    rows: list[PromptRow]
    indices: list[int]
    """Dataset indices of the rows."""
    epoch: int

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def prompt_ids(self) -> list[list[int]]:
        """What ``Rollout.generate`` takes."""
        return [r.prompt_ids for r in self.rows]

    @property
    def prompts(self) -> list[str]:
        return [r.prompt for r in self.rows]

    @property
    def ground_truths(self) -> list[str | None]:
        return [r.ground_truth for r in self.rows]

    @property
    def metas(self) -> list[dict[str, Any]]:
        return [r.meta for r in self.rows]

    def sample_meta(self, n: int = 1) -> dict[str, list[Any]]:
        """Per-sample metadata for the ``n`` samples of each prompt, prompt-major (as
        ``SamplingParams.n`` lays out rollouts): ``prompt``, ``ground_truth``, ``data_meta``,
        ``prompt_messages`` (the row's messages for a conversational row, else ``None``: what
        a TRL reward function gets as its prompt) and ``uid`` (``"<epoch>:<index>"``, equal
        for samples of one prompt: a group id)."""

        def rep(values: list[Any]) -> list[Any]:
            return [v for v in values for _ in range(n)]

        return {
            "prompt": rep(self.prompts),
            "ground_truth": rep(self.ground_truths),
            "data_meta": rep(self.metas),
            "prompt_messages": rep([r.messages for r in self.rows]),
            "uid": rep([f"{self.epoch}:{i}" for i in self.indices]),
        }


class PromptLoader:
    """Batches of ``batch_size`` prompts, epoch after epoch.

    The order of epoch ``e`` is a permutation drawn from ``(seed, e)`` alone (identity
    without ``shuffle``), so it is the same in every process and after a restart. The
    position is ``(epoch, index)`` — ``index`` counts prompts already taken this epoch —
    and :meth:`state_dict` / :meth:`load_state_dict` save and restore it: a loader
    restored from a state gives exactly the batches the saved one would have given next.

    With ``drop_last`` an epoch's incomplete tail is skipped; without it the last batch
    of an epoch is smaller. ``next_batch`` rolls over epochs; iterating yields the
    remaining batches of the current epoch.
    """

    def __init__(
        self, dataset: PromptDataset, batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and batch_size > len(dataset):
            raise DataError(
                f"{dataset.source}: batch_size {batch_size} is larger than the {len(dataset)} prompts; "
                "lower data.batch_size or set drop_last=false"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.index = 0
        self._fingerprint: str | None = None
        self._order_epoch: int | None = None
        self._order: list[int] = []

    @classmethod
    def from_config(cls, dataset: PromptDataset) -> PromptLoader:
        cfg = dataset.config
        return cls(dataset, cfg.batch_size, shuffle=cfg.shuffle, seed=cfg.seed, drop_last=cfg.drop_last)

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def order(self, epoch: int) -> list[int]:
        """The dataset indices of ``epoch`` in the order they are served."""
        if self._order_epoch != epoch:
            n = len(self.dataset)
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(n).tolist()
            else:
                self._order = list(range(n))
            self._order_epoch = epoch
        return self._order

    def _epoch_done(self) -> bool:
        left = len(self.dataset) - self.index
        return left <= 0 or (self.drop_last and left < self.batch_size)

    def _take(self) -> PromptBatch:
        indices = self.order(self.epoch)[self.index : self.index + self.batch_size]
        batch = PromptBatch(rows=[self.dataset[i] for i in indices], indices=indices, epoch=self.epoch)
        self.index += len(indices)
        return batch

    def next_batch(self) -> PromptBatch:
        """The next batch, starting the next epoch when this one is used up."""
        if self._epoch_done():
            self.epoch, self.index = self.epoch + 1, 0
        return self._take()

    def __iter__(self) -> Iterator[PromptBatch]:
        """The remaining batches of the current epoch; afterwards the loader stands at the
        start of the next epoch."""
        if self._epoch_done():
            self.epoch, self.index = self.epoch + 1, 0
        start = self.epoch
        while self.epoch == start and not self._epoch_done():
            yield self._take()
        if self.epoch == start:
            self.epoch, self.index = self.epoch + 1, 0

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The position plus what must match on resume."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self.dataset),
            "fingerprint": self.fingerprint(),
        }

    def fingerprint(self) -> str:
        """A digest of the prompts in dataset order (their token ids and ground truths): a
        resume over other data of the same size was noticed by nothing (computed once)."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            for row in self.dataset.rows:
                digest.update(json.dumps([row.prompt_ids, row.ground_truth], default=str).encode())
                digest.update(b"\n")
            self._fingerprint = digest.hexdigest()[:16]
        return self._fingerprint

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict`. The dataset (its size after
        filtering), the seed and the shuffle flag must be those of the saved loader; the
        batch size may differ (the position counts prompts)."""
        mismatched = [
            f"{key} {state[key]!r} (now {now!r})"
            for key, now in (("seed", self.seed), ("shuffle", self.shuffle), ("num_prompts", len(self.dataset)))
            if state.get(key) != now
        ]
        if not mismatched and state.get("fingerprint", self.fingerprint()) != self.fingerprint():
            # an older checkpoint has no fingerprint: nothing to compare
            mismatched.append(
                f"other prompts (the same number, {len(self.dataset)}, with other contents or in another order)"
            )
        if mismatched:
            raise DataError(
                f"{self.dataset.source}: cannot resume the prompt loader, the checkpoint was saved with "
                + ", ".join(mismatched)
                + "; resume with the same data and seed"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
