"""How tool calls look in the model's text, and how their results are shown back.

A :class:`CallFormat` gives the texts that end a model turn (the rollout stops right after
one: a turn that calls a tool ends with its call; ``hermes`` under a chat template leaves
the end of the turn to the template's EOS, so a turn may make several calls), parses a turn into
:class:`ToolCall`s (or errors for malformed calls), and writes the results as the
observation text. Two built-ins:

* ``hermes`` — ``<tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call>``
  (Qwen, Llama 3.x, Hermes chat models); results as ``<tool_response>...</tool_response>``;
* ``compact`` — ``[calc 123*45]``, the result as ``(5535)``: short enough for a tiny
  character-level model to learn. The text after the tool name is the tool's first
  argument.

When the model has a chat template, :func:`chat_bridge` renders an observation as a
turn of that template (closing the assistant's turn, the tool turn, opening the next
assistant turn): all of that "bridge" text becomes observation tokens, masked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from geartrain.errors import GeartrainError

__all__ = [
    "CallFormat",
    "CompactFormat",
    "HermesFormat",
    "ToolCall",
    "ToolOutcome",
    "chat_bridge",
    "chat_opening",
    "get_call_format",
    "user_turn_tail",
]


@dataclass(kw_only=True, slots=True)
class ToolCall:
    """One parsed call: the tool's name and its keyword arguments. ``positional`` holds
    the compact format's free text, bound to the tool's first parameter."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    positional: str | None = None


@dataclass(kw_only=True, slots=True)
class ToolOutcome:
    """What one call gave: its result text, or an error message (``ok`` False)."""

    name: str
    ok: bool
    text: str
    seconds: float = 0.0


class CallFormat(Protocol):
    """See the module docstring."""

    name: str

    def stop_texts(self, *, chat: bool = False) -> list[str]:
        """Texts that end a model turn when generated (the text is kept in the turn).
        ``chat``: turns are rendered with the chat template, whose end of turn (the EOS
        token) also ends one; a format may then leave more to it."""
        ...

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        """The calls in a model turn, and one message per malformed call. No calls and
        no errors: the turn is a final answer."""
        ...

    def results_text(self, outcomes: Sequence[ToolOutcome], *, chat: bool) -> list[str]:
        """One text per outcome: the content of a tool turn when ``chat`` (the chat
        template wraps it), else the text appended verbatim."""
        ...


class HermesFormat:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    name = "hermes"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def stop_texts(self, *, chat: bool = False) -> list[str]:
        # in a chat-templated turn the model ends its turn itself (EOS), as TRL and verl
        # let it: one turn may hold several calls; as plain text, a call ends the turn
        return [] if chat else ["</tool_call>"]

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        calls: list[ToolCall] = []
        errors: list[str] = []
        for body in self._CALL.findall(text):
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as exc:
                errors.append(f"tool call is not valid JSON ({exc.msg}): {body.strip()[:200]}")
                continue
            if not isinstance(obj, Mapping) or not isinstance(obj.get("name"), str):
                errors.append(f"tool call needs a string 'name': {body.strip()[:200]}")
                continue
            args = obj.get("arguments", {})
            if isinstance(args, str):  # some models emit the arguments as a JSON string
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    errors.append(f"tool call '{obj['name']}': arguments are not a JSON object: {args[:200]}")
                    continue
            if not isinstance(args, Mapping):
                errors.append(f"tool call '{obj['name']}': arguments must be an object, got {type(args).__name__}")
                continue
            calls.append(ToolCall(name=obj["name"], arguments=dict(args)))
        if "<tool_call>" in text and text.count("<tool_call>") > len(self._CALL.findall(text)):
            errors.append("an unclosed <tool_call> (no </tool_call>)")
        return calls, errors

    def results_text(self, outcomes: Sequence[ToolOutcome], *, chat: bool) -> list[str]:
        texts = [o.text if o.ok else f"error: {o.text}" for o in outcomes]
        if chat:
            return texts
        return ["".join(f"<tool_response>\n{t}\n</tool_response>\n" for t in texts)]


class CompactFormat:
    """``[name text]`` -> ``(result)``; an error as ``(error: message)``."""

    name = "compact"
    _CALL = re.compile(r"\[([A-Za-z_][A-Za-z0-9_]*)(?: ([^\[\]]*))?\]")

    def stop_texts(self, *, chat: bool = False) -> list[str]:
        return ["]"]

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        calls = [
            ToolCall(name=m.group(1), positional=None if m.group(2) is None else m.group(2).strip())
            for m in self._CALL.finditer(text)
        ]
        errors = []
        opened = text.count("[")
        if opened > len(calls) or (not calls and "]" in text):
            errors.append("malformed call")  # short: the observation costs the episode's tokens
        return calls, errors

    def results_text(self, outcomes: Sequence[ToolOutcome], *, chat: bool) -> list[str]:
        texts = [f"({o.text})" if o.ok else f"(error: {o.text})" for o in outcomes]
        return texts if chat else ["".join(texts)]


_FORMATS: dict[str, type] = {"hermes": HermesFormat, "compact": CompactFormat}


def get_call_format(spec: str | CallFormat) -> CallFormat:
    """A built-in format by name (``hermes``, ``compact``), or ``spec`` itself."""
    if not isinstance(spec, str):
        return spec
    if spec not in _FORMATS:
        raise GeartrainError(f"unknown tool call format '{spec}'; known: {', '.join(_FORMATS)}")
    return _FORMATS[spec]()


_SENTINEL = "\x1fGEARTRAIN_TURN\x1f"


def chat_template_errors() -> tuple[type[BaseException], ...]:
    """What a chat template that fails as it renders raises: jinja's own errors (the
    template's ``raise_exception``, a syntax error, the sandbox's refusal) and the Python
    errors its expressions raise (``{{ 1/0 }}``, ``int('x')``, ``range(10**9)``)."""
    from jinja2 import TemplateError

    return (TemplateError, ArithmeticError, LookupError, TypeError, ValueError, RecursionError)


def _render(tokenizer: Any, messages: list[dict[str, str]], **kwargs: Any) -> str:
    """``tokenizer.apply_chat_template(messages, **kwargs)``; a template that fails (jinja's
    sandbox refusing an attribute, a syntax error, the template's own ``raise_exception``), or
    none to render, is a :class:`GeartrainError` naming the setting that turns it off."""
    if not getattr(tokenizer, "chat_template", None):
        raise GeartrainError(
            "rollout.agent.chat_template = true renders observations with the tokenizer's chat template, and this "
            "tokenizer has none; set rollout.agent.chat_template = false to append observations as plain text"
        )
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except chat_template_errors() as exc:
        raise GeartrainError(
            f"the tokenizer's chat template failed ({type(exc).__name__}: {exc}); fix the template "
            "(chat_template.jinja or tokenizer_config.json of the model), or set rollout.agent.chat_template = false "
            "to append observations as plain text"
        ) from None


def chat_bridge(tokenizer: Any, contents: Sequence[str], role: str = "tool") -> str:
    """The text a chat template puts between the end of an assistant turn's content and
    the start of the next assistant turn's content, with one ``role`` message per entry of
    ``contents`` in between. Raises :class:`GeartrainError` when the template does not
    render an assistant turn as a prefix of the longer conversation."""
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
    longer = base + [{"role": role, "content": c} for c in contents]
    text = _render(tokenizer, longer, tokenize=False, add_generation_prompt=True)
    head = _render(tokenizer, base, tokenize=False)
    cut = head.find(_SENTINEL)
    if cut < 0 or not text.startswith(head[: cut + len(_SENTINEL)]):
        raise GeartrainError(
            "the tokenizer's chat template does not render the conversation so far as a prefix of the next one; "
            "set rollout.agent.chat_template = false to append observations as plain text"
        )
    return text[cut + len(_SENTINEL) :]


def chat_opening(tokenizer: Any, contents: Sequence[str], role: str = "tool") -> tuple[str, str]:
    """For observations that come *before* the first assistant turn (an environment's
    ``reset``): ``(generation prompt, replacement)``, the text the template puts after a
    user turn to open the assistant's turn, and the text it puts there instead when one
    ``role`` message per entry of ``contents`` comes first (those turns, then the same
    opening). Raises :class:`GeartrainError` when the template does not render the shorter
    conversation as a prefix of the longer one."""
    base = [{"role": "user", "content": _SENTINEL}]
    closed = _render(tokenizer, base, tokenize=False)
    opened = _render(tokenizer, base, tokenize=False, add_generation_prompt=True)
    longer = _render(
        tokenizer, base + [{"role": role, "content": c} for c in contents], tokenize=False, add_generation_prompt=True
    )
    if not (opened.startswith(closed) and longer.startswith(closed)):
        raise GeartrainError(
            "the tokenizer's chat template does not render a conversation as a prefix of a longer one; "
            "set rollout.agent.chat_template = false to append observations as plain text"
        )
    return opened[len(closed) :], longer[len(closed) :]


def user_turn_tail(tokenizer: Any) -> str:
    """The text a chat template puts after a user message's content up to the start of
    the assistant's content (end of the user turn, then the generation prompt); ``""``
    when the tokenizer has no chat template. Text inserted right before it is appended to
    the last user message, as TRL does with an environment's ``reset`` observation."""
    if not getattr(tokenizer, "chat_template", None):
        return ""
    opened = _render(tokenizer, [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True)
    return opened.split(_SENTINEL, 1)[1] if _SENTINEL in opened else ""
