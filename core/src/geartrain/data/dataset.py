"""Prompt datasets: validated rows, rendered through the chat template when configured,
tokenized, and filtered by length."""

from __future__ import annotations

import difflib
import logging
import math
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from geartrain.data.config import DataConfig
from geartrain.data.sources import DataSource, read_rows, source_name
from geartrain.errors import DataError

logger = logging.getLogger("geartrain.data")


@dataclass(kw_only=True, slots=True)
class PromptRow:
    """One prompt, ready for the rollout."""

    prompt_ids: list[int]
    """Token ids fed to the rollout (chat template applied when configured)."""
    prompt: str
    """The text those ids encode."""
    ground_truth: str | None
    meta: dict[str, Any] = field(default_factory=dict)
    """The row's other fields, untouched."""
    messages: list[dict[str, str]] | None = None
    """The conversation, for ``messages`` rows."""
    where: str = ""
    """Source and row number (``"train.jsonl, line 7"``)."""
    ground_truth_value: str | int | float | None = None
    """The ground truth as the row holds it (a number stays one: what TRL's ``reset`` gets)."""


@dataclass(kw_only=True, slots=True)
class _Parsed:
    where: str
    prompt: str | None
    messages: list[dict[str, str]] | None
    ground_truth: str | None
    meta: dict[str, Any]
    messages_from: str = ""
    """The key the messages were read from (``messages_key``, or ``prompt_key`` for TRL's
    conversational rows)."""
    ground_truth_value: str | int | float | None = None
    unread_keys: list[str] = field(default_factory=list)
    """Keys of the row's messages other than role and content (``tool_calls``, ``name``),
    which are not passed on."""


def _is_conversation(value: Any) -> bool:
    """Whether a prompt column's value is a list of messages rather than text (TRL's
    conversational format: ``{"prompt": [{"role": "user", "content": ...}]}``)."""
    # numpy arrays come from some Parquet readers; a numpy scalar (ndim 0) is not a list
    return isinstance(value, list | tuple) or (hasattr(value, "tolist") and getattr(value, "ndim", 0) >= 1)


class PromptDataset:
    """Prompts read from ``source`` (JSONL/Parquet path, ``datasets.Dataset`` or a list of
    dicts) under ``config``'s schema, tokenized with ``tokenizer``.

    A malformed row raises :class:`geartrain.DataError` naming the source and the row
    (1-based; the line number for JSONL). Prompts longer than ``config.max_prompt_length``
    tokens are dropped; ``num_filtered`` says how many, and the count is logged.

    ``tools`` (JSON-schema function specs, e.g. a tool environment's ``tools``) are passed
    to the chat template where one is applied, as ``apply_chat_template(..., tools=...)``:
    the template shows the model which tools exist and their arguments (TRL and verl do the
    same). Plain prompts (no template) are unchanged by them. With named environments
    (``environment_tools``: each name's specs), each row gets the tools of the environment
    its ``environment_key`` column names; a row naming none of them is refused.

    ``prompt_optional`` (a multi-turn job, whose environment may own the task: TRL's rule):
    a row with neither a prompt nor messages is an empty user message, for the
    environment's ``reset`` to fill (under the chat template).
    """

    def __init__(
        self,
        source: DataSource,
        tokenizer: Any,
        config: DataConfig | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] = (),
        environment_tools: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
        environment_key: str = "environment",
        prompt_optional: bool = False,
    ) -> None:
        self.config = config or DataConfig()
        self.prompt_optional = prompt_optional
        self.tools = [dict(t) for t in tools]
        self.environment_tools = (
            None if environment_tools is None else {k: [dict(t) for t in v] for k, v in environment_tools.items()}
        )
        self.environment_key = environment_key
        self.source = source_name(source)
        parsed = [self._parse(where, row) for where, row in read_rows(source)]
        if not parsed:
            raise DataError(f"{self.source}: no rows")
        self._check_template_keeps_messages(parsed, tokenizer)
        _warn_unusual_roles(self.source, parsed)
        _warn_unread_message_keys(self.source, parsed)
        _warn_invisible_ground_truth(self.source, parsed, self.config.ground_truth_key)
        # a text longer than this holds more than max_prompt_length tokens: it is dropped
        # without being tokenized (a 50 MB row must not be tokenized whole to be thrown away),
        # and as soon as it is rendered (a template emitting 100 MB a row must not be held
        # for every row before the filter)
        bound = (self.config.max_prompt_length + 1) * longest_token_chars(tokenizer)
        total = len(parsed)
        fitting: list[_Parsed] = []
        texts: list[str] = []
        for p in parsed:
            text = self._render(p, tokenizer)
            if len(text) <= bound:
                fitting.append(p)
                texts.append(text)
        parsed = fitting
        self.num_filtered = total - len(parsed)
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        _warn_unknown_characters(self.source, parsed, texts, ids, tokenizer)
        self.rows: list[PromptRow] = []
        for p, text, prompt_ids in zip(parsed, texts, ids, strict=True):
            if len(prompt_ids) > self.config.max_prompt_length:
                self.num_filtered += 1
                continue
            self.rows.append(
                PromptRow(
                    prompt_ids=list(prompt_ids),
                    prompt=text,
                    ground_truth=p.ground_truth,
                    meta=p.meta,
                    messages=p.messages,
                    where=p.where,
                    ground_truth_value=p.ground_truth_value,
                )
            )
        if self.num_filtered:
            logger.warning(
                "%s: dropped %d of %d prompts longer than max_prompt_length=%d tokens",
                self.source,
                self.num_filtered,
                total,
                self.config.max_prompt_length,
            )
        if not self.rows:
            raise DataError(
                f"{self.source}: every prompt is longer than max_prompt_length={self.config.max_prompt_length} "
                "tokens; raise data.max_prompt_length"
            )

    @classmethod
    def from_config(cls, config: DataConfig, tokenizer: Any) -> PromptDataset:
        """The dataset at ``config.path``."""
        if config.path is None:
            raise DataError("data.path is not set; give a .jsonl/.json/.parquet/.csv file or a directory")
        return cls(config.path, tokenizer, config)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> PromptRow:
        return self.rows[index]

    # ------------------------------------------------------------------ internals
    def _parse(self, where: str, row: Any) -> _Parsed:
        cfg = self.config
        if not isinstance(row, Mapping):
            raise DataError(
                f"{where}: a row must be an object with '{cfg.prompt_key}' or '{cfg.messages_key}', "
                f"got {type(row).__name__}"
            )
        # no prompt in a multi-turn job: the environment's reset supplies the task (TRL's rule)
        unprompted = self.prompt_optional and row.get(cfg.prompt_key) is None and row.get(cfg.messages_key) is None
        unread: list[str] = []
        if unprompted:
            prompt, messages, messages_from = None, None, cfg.messages_key
        else:
            prompt, messages, messages_from = self._prompt_or_messages(where, row)
        if prompt is not None and (not isinstance(prompt, str) or not prompt):
            raise DataError(
                f"{where}: '{cfg.prompt_key}' must be a non-empty string or a list of {{role, content}} messages "
                f"(TRL's conversational format), got {prompt!r:.80}"
            )
        if isinstance(prompt, str) and not prompt.strip():
            raise DataError(
                f"{where}: '{cfg.prompt_key}' is only whitespace ({prompt!r:.40}); give the row a prompt or remove it"
            )
        if unprompted:
            if cfg.apply_chat_template is False:
                raise DataError(
                    f"{where}: a row without '{cfg.prompt_key}' is an empty user message for the environment's reset "
                    "to fill, which needs data.apply_chat_template (true or unset)"
                )
            messages = [{"role": "user", "content": ""}]
        elif messages is not None:
            messages, unread = self._check_messages(where, messages, messages_from)
            if not any(m["content"].strip() for m in messages):
                raise DataError(
                    f"{where}: every message of '{messages_from}' is empty or whitespace; "
                    "give the row a prompt or remove it"
                )
        truth = row.get(cfg.ground_truth_key)
        if truth is None:
            if cfg.require_ground_truth:
                raise DataError(f"{where}: missing '{cfg.ground_truth_key}' (or set data.require_ground_truth=false)")
        elif isinstance(truth, bool) or not isinstance(truth, str | int | float):
            raise DataError(
                f"{where}: '{cfg.ground_truth_key}' must be a string or a number, got {type(truth).__name__}"
            )
        elif isinstance(truth, float) and not math.isfinite(truth):
            raise DataError(f"{where}: '{cfg.ground_truth_key}' is {truth}, which no response can match")
        value = truth
        if truth is not None:
            truth = str(truth)
        used = {cfg.prompt_key, cfg.messages_key, cfg.ground_truth_key}
        meta = {k: v for k, v in row.items() if k not in used}
        if self.environment_tools is not None and meta.get(self.environment_key) not in self.environment_tools:
            value = meta.get(self.environment_key)
            raise DataError(
                f"{where}: '{self.environment_key}' must name the row's environment, one of "
                f"{', '.join(self.environment_tools)} (rollout.agent.environment), "
                f"got {'nothing' if value is None else repr(value)}"
            )
        return _Parsed(
            where=where,
            prompt=prompt,
            messages=messages,
            ground_truth=truth,
            meta=meta,
            messages_from=messages_from,
            ground_truth_value=value,
            unread_keys=unread,
        )

    def _prompt_or_messages(self, where: str, row: Mapping[str, Any]) -> tuple[Any, Any, str]:
        """``(prompt, messages, the key the messages come from)``, exactly one of the first
        two set. The value's type decides: a list under the prompt key is a conversation
        (TRL's conversational format), anything else there a plain prompt (checked later);
        with ``messages_key == prompt_key`` the one column holds either."""
        cfg = self.config
        prompt = row.get(cfg.prompt_key)
        messages = row.get(cfg.messages_key) if cfg.messages_key != cfg.prompt_key else None
        if _is_conversation(prompt):
            if messages is not None:
                raise DataError(
                    f"{where}: a row needs exactly one of '{cfg.prompt_key}' and '{cfg.messages_key}', it has both"
                )
            return None, prompt, cfg.prompt_key
        # a key that is there with a null value is named: "neither" alone reads as a missing key
        nulls = [key for key in dict.fromkeys((cfg.prompt_key, cfg.messages_key)) if key in row and row[key] is None]
        null_note = ""
        if nulls:
            null_note = f" ({' and '.join(repr(k) for k in nulls)} {'is' if len(nulls) == 1 else 'are'} null)"
        if prompt is None and messages is None and cfg.messages_key == cfg.prompt_key:
            raise DataError(
                f"{where}: a row needs '{cfg.prompt_key}' (a string or a list of {{role, content}} messages)"
                + null_note
                + _near_key_note(row, cfg.prompt_key)
            )
        if (prompt is None) == (messages is None):
            which = "both" if prompt is not None else "neither"
            raise DataError(
                f"{where}: a row needs exactly one of '{cfg.prompt_key}' and '{cfg.messages_key}', it has {which}"
                + null_note
                + ("" if prompt is not None else _near_key_note(row, cfg.prompt_key, cfg.messages_key))
            )
        return prompt, messages, cfg.messages_key

    def _check_messages(self, where: str, messages: Any, key: str) -> tuple[list[dict[str, str]], list[str]]:
        """The messages as ``{role, content}`` dicts, and the other keys they hold (not read)."""
        if hasattr(messages, "tolist"):  # numpy arrays from some Parquet readers
            messages = messages.tolist()
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: '{key}' must be a non-empty list of {{role, content}} objects")
        checked, unread = [], []
        for i, message in enumerate(messages):
            if (
                not isinstance(message, Mapping)
                or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str)
            ):
                raise DataError(
                    f"{where}: '{key}'[{i}] must be an object with string 'role' and 'content', got {message!r:.80}"
                )
            checked.append({"role": message["role"], "content": message["content"]})
            # a Parquet struct column gives every message every key, the absent ones as None
            unread.extend(k for k, v in message.items() if k not in ("role", "content") and v is not None)
        return checked, unread

    def _uses_template(self, parsed: _Parsed) -> bool:
        cfg = self.config
        return cfg.apply_chat_template if cfg.apply_chat_template is not None else parsed.messages is not None

    def _check_template_keeps_messages(self, parsed: list[_Parsed], tokenizer: Any) -> None:
        """Refuse a chat template that leaves out the user's message (every prompt would be
        the same text: a silent wrong result) or, where the job has system messages
        (``data.system_prompt`` or the rows' own), the system message (its content would be
        lost). Rendered once, on marker messages; a template that fails on them is left to
        fail on the first row, which names it."""
        rows = [p for p in parsed if self._uses_template(p)]
        if not rows or not getattr(tokenizer, "chat_template", None):
            return
        has_system = self.config.system_prompt is not None or any(
            m["role"] == "system" for p in rows for m in (p.messages or ())
        )
        user, system = "geartrain-marker-user-5f1c", "geartrain-marker-system-9b2e"
        messages = [{"role": "user", "content": user}]
        if has_system:
            messages.insert(0, {"role": "system", "content": system})
        from geartrain.agents.formats import chat_template_errors

        try:
            text = str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)).lower()
        except chat_template_errors():
            return
        fix = "fix the template (chat_template.jinja or tokenizer_config.json of the model)"
        if user not in text:
            raise DataError(
                f"{self.source}: the tokenizer's chat template leaves out the user message's content, so every "
                f"prompt would render as the same text; {fix}, or set data.apply_chat_template=false"
            )
        if has_system and system not in text:
            where = "data.system_prompt" if self.config.system_prompt is not None else "the rows' system messages"
            raise DataError(
                f"{self.source}: the tokenizer's chat template leaves out system messages, so {where} would be lost; "
                f"{fix}, or drop {where}"
            )

    def _render(self, parsed: _Parsed, tokenizer: Any) -> str:
        cfg = self.config
        if not self._uses_template(parsed):
            if parsed.messages is not None:
                raise DataError(
                    f"{parsed.where}: '{parsed.messages_from}' rows need data.apply_chat_template (true or unset): "
                    "they hold messages"
                )
            assert parsed.prompt is not None
            return parsed.prompt
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(
                f"{parsed.where}: the chat template is to be applied but the tokenizer has none; "
                "set data.apply_chat_template=false and use plain prompts"
            )
        messages = parsed.messages or [{"role": "user", "content": parsed.prompt or ""}]
        if cfg.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
        tools = (
            self.tools if self.environment_tools is None else self.environment_tools[parsed.meta[self.environment_key]]
        )
        extra = {"tools": tools} if tools else {}
        # a conversation ending with an assistant message is a prefix the model continues
        # (TRL's continue_final_message), not a turn followed by a new assistant header
        last_is_assistant = messages[-1]["role"] == "assistant"
        from geartrain.agents.formats import chat_template_errors

        try:
            return tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=not last_is_assistant,
                continue_final_message=last_is_assistant,
                tokenize=False,
                **extra,
            )
        except chat_template_errors() as exc:
            raise DataError(
                f"{parsed.where}: the tokenizer's chat template failed on this row ({type(exc).__name__}: {exc}); "
                "fix the template (chat_template.jinja or tokenizer_config.json of the model) or the row, or set "
                "data.apply_chat_template=false"
            ) from None


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` stands for: its longest vocabulary
    entry, at least 8 (64 where the vocabulary cannot be read). A text longer than ``n``
    times this holds more than ``n`` tokens, whatever the tokenizer makes of it."""
    try:
        return max(8, max((len(t) for t in tokenizer.get_vocab()), default=1))
    except Exception:  # noqa: BLE001 - any tokenizer: an upper bound is enough
        return 64


def _near_key_note(row: Mapping[str, Any], *wanted: str) -> str:
    """For a row that lacks the ``wanted`` keys: its key that looks like one of them (another
    case, a typo) and how to read it, or ``""``."""
    keys = [k for k in row if isinstance(k, str) and k not in wanted]  # a wanted key present is null, said apart
    for want in wanted:
        near = [k for k in keys if k.lower() == want.lower()] or difflib.get_close_matches(want, keys, n=1, cutoff=0.75)
        if near:
            option = "data.messages_key" if want == wanted[-1] and len(wanted) > 1 else "data.prompt_key"
            return f"; it has {near[0]!r}: did you mean {want!r}? (rename the key, or set {option}={near[0]!r})"
    return ""


@dataclass(slots=True)
class _Tally:
    """What one dataset warning found across the rows: how many, in how many rows, and
    the first three with their rows."""

    count: int = 0
    rows: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, where: str, found: Sequence[str]) -> None:
        """Count ``found`` (already worded for the warning) for the row at ``where``."""
        if found:
            self.count += len(found)
            self.rows += 1
            if len(self.examples) < 3:
                self.examples.append(f"{found[0]} ({where})")


#: the message roles of OpenAI's chat format, which chat templates are written for
USUAL_ROLES = ("system", "developer", "user", "assistant", "tool")


def _warn_unusual_roles(source: str, parsed: list[_Parsed]) -> None:
    """Warn once per dataset about messages whose role is none of :data:`USUAL_ROLES` (a
    typo such as ``usr`` reaches the chat template unseen; some templates drop such a
    turn, others render it as it is): how many, in how many rows, the first few with their
    rows. Not refused: a model's own template may define roles of its own (``ipython``)."""
    tally = _Tally()
    for p in parsed:
        tally.add(p.where, [repr(m["role"]) for m in p.messages or () if m["role"] not in USUAL_ROLES])
    if tally.count:
        logger.warning(
            "%s: %d message(s) in %d row(s) have a role that is none of %s: e.g. %s. The chat template gets them as "
            "they are (a typo?)",
            source,
            tally.count,
            tally.rows,
            ", ".join(USUAL_ROLES),
            ", ".join(tally.examples),
        )


def _warn_unread_message_keys(source: str, parsed: list[_Parsed]) -> None:
    """Warn once per dataset about message keys other than ``role`` and ``content``
    (``tool_calls``, ``name``): only those two reach the chat template, so a conversation
    whose meaning is in the others (an assistant's tool calls) is not what the model sees."""
    tally = _Tally()
    for p in parsed:
        tally.add(p.where, [repr(key) for key in p.unread_keys])
    if tally.count:
        logger.warning(
            "%s: %d message key(s) in %d row(s) are neither 'role' nor 'content' and are not read (only those two "
            "reach the chat template): e.g. %s. Put what the model should see in 'content'",
            source,
            tally.count,
            tally.rows,
            ", ".join(tally.examples),
        )


def _warn_invisible_ground_truth(source: str, parsed: list[_Parsed], key: str) -> None:
    """Warn once per dataset about ground truths holding invisible format characters
    (Unicode's category Cf: zero-width spaces, direction marks, a byte-order mark), which
    come from copying text out of web pages and documents: a reward comparing text
    (``exact_match``) compares them too, so no response the model writes can match."""
    tally = _Tally()
    for p in parsed:
        if p.ground_truth is not None and not p.ground_truth.isascii():
            found = [c for c in p.ground_truth if unicodedata.category(c) == "Cf"]
            tally.add(p.where, [f"U+{ord(c):04X} {unicodedata.name(c, '')}".rstrip() for c in found])
    if tally.count:
        logger.warning(
            "%s: %d invisible character(s) in the '%s' of %d row(s): e.g. %s. A reward that compares text "
            "(exact_match) compares them too, so no response can match such a row; remove them from the data",
            source,
            tally.count,
            key,
            tally.rows,
            ", ".join(tally.examples),
        )


def _warn_unknown_characters(
    source: str, parsed: list[_Parsed], texts: list[str], ids: list[list[int]], tokenizer: Any
) -> None:
    """Warn once per dataset when prompt characters are outside the tokenizer's vocabulary
    (they become its unknown token, which the model cannot tell apart): how many, in how
    many prompts, and the first few with their rows. Only prompts holding the unknown
    token's id are scanned, so a byte-level tokenizer costs nothing here."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return
    unk_text = getattr(tokenizer, "unk_token", None) or ""
    verdict: dict[str, bool] = {}

    def unknown(char: str) -> bool:
        if char not in verdict:
            verdict[char] = unk in tokenizer(char, add_special_tokens=False)["input_ids"] and char not in unk_text
        return verdict[char]

    tally = _Tally()
    for p, text, row_ids in zip(parsed, texts, ids, strict=True):
        if unk in row_ids:
            tally.add(p.where, [repr(c) for c in (text.replace(unk_text, "") if unk_text else text) if unknown(c)])
    if tally.count:
        logger.warning(
            "%s: %d character(s) in %d prompt(s) are not in the tokenizer's vocabulary and become %s, which the model "
            "cannot tell apart: e.g. %s. Normalize the text, or use a tokenizer that covers it",
            source,
            tally.count,
            tally.rows,
            unk_text or f"token {unk}",
            ", ".join(tally.examples),
        )
