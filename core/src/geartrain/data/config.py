"""The ``data`` config section."""

from __future__ import annotations

from pydantic import AliasChoices, Field

from geartrain.config import OptionalPath, Section
from geartrain.limits import MAX_SEED


class DataConfig(Section):
    """Where prompts come from and how they are batched.

    Row schema (JSONL object, Parquet row or ``datasets.Dataset`` row): exactly one of
    ``prompt`` (str) and ``messages`` (a list of ``{"role": str, "content": str}``), a
    ``ground_truth`` (str or number), and any other fields, kept as the row's ``meta``.
    A list of messages under ``prompt`` is read as ``messages`` (TRL's conversational
    format, ``{"prompt": [{"role": "user", "content": ...}]}``): the value's type decides.
    The key names are configurable, and may be the same column.
    """

    path: OptionalPath = None
    """A ``.jsonl``, ``.json``, ``.parquet`` or ``.csv`` file, a directory of such files, or
    a directory written by ``datasets``' ``save_to_disk`` (hub ids are not downloaded);
    ``run_job(config, data=...)`` takes a ``datasets.Dataset`` or a list of dicts instead."""
    prompt_key: str = "prompt"
    """Field of a row that holds a plain prompt (or, TRL's conversational format, a list of
    messages)."""
    messages_key: str = "messages"
    """Field of a row that holds chat messages (may equal ``prompt_key``)."""
    ground_truth_key: str = Field("ground_truth", validation_alias=AliasChoices("ground_truth_key", "answer_key"))
    """Field of a row that holds the ground truth (``answer_key`` is accepted as its other
    name), e.g. ``"answer"`` for a dataset whose column is called so."""

    @property
    def answer_key(self) -> str:
        """The other name of ``ground_truth_key`` (``data.answer_key`` in a job file, in
        ``DataConfig(answer_key=...)`` and ``config.data.answer_key = ...``)."""
        return self.ground_truth_key

    @answer_key.setter
    def answer_key(self, value: str) -> None:
        self.ground_truth_key = value

    require_ground_truth: bool = True
    """Rows without a ground truth are malformed (rule rewards need one)."""
    apply_chat_template: bool | None = None
    """``True``: every prompt goes through the tokenizer's chat template (a plain prompt
    becomes one user message); ``False``: never (``messages`` rows are then errors);
    ``None``: only ``messages`` rows."""
    system_prompt: str | None = None
    """Prepended as a system message when the chat template is applied."""
    max_prompt_length: int = Field(512, ge=1)
    """Prompts longer than this many tokens are dropped (counted and logged)."""
    batch_size: int = Field(8, ge=1)
    """Prompts per step."""
    shuffle: bool = True
    """Shuffle prompts every epoch."""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seed of the shuffle."""
    drop_last: bool = True
    """Skip an epoch's last, incomplete batch."""
