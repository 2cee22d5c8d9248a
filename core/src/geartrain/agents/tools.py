"""Tools (Python functions with JSON-schema arguments) and the built-in tool environment.

:class:`Tool` wraps a function; its argument schema comes from the signature's annotations
unless given. A plain function given to :class:`ToolEnvironment` is specified as TRL and
``apply_chat_template(tools=[fn])`` specify it (:func:`tool_of_function`).
:class:`ToolEnvironment` is an :class:`~geartrain.agents.Environment` that
parses calls from each model turn with a :class:`~geartrain.agents.formats.CallFormat`,
runs them concurrently (each on a daemon thread, so a hung tool cannot hang the job's
exit) with a per-call timeout, and shows the results, or the errors, as the observation.
A tool that raises, one that runs past its timeout, an unknown tool, bad arguments and a
malformed call each become an error observation, counted in the step's ``info``; the
episode goes on. A turn with no call is the final answer (``done``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import re
import threading
import time
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from geartrain.agents.environment import Environment, StepResult
from geartrain.agents.formats import CallFormat, ToolCall, ToolOutcome, get_call_format
from geartrain.errors import GeartrainError, text_of
from geartrain.user_code import import_object

__all__ = ["Tool", "ToolEnvironment", "run_sync", "run_with_timeout", "schema_of", "tool", "tool_of_function"]

_JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
}


def _json_type(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _json_type(options[0]) if len(options) == 1 else {}
    base = origin or annotation
    return {"type": _JSON_TYPES[base]} if base in _JSON_TYPES else {}


def schema_of(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of ``fn``'s keyword arguments from its signature: annotated
    ``str``/``int``/``float``/``bool``/``list``/``dict`` become their JSON types,
    parameters without a default are ``required``."""
    hints = typing.get_type_hints(fn) if not isinstance(fn, type) else {}
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        properties[name] = _json_type(hints.get(name, param.annotation))
        if param.default is inspect.Parameter.empty:
            required.append(name)
    return {"type": "object", "properties": properties, "required": required}


@dataclass(kw_only=True)
class Tool:
    """A function the model may call. ``parameters`` is the JSON schema of its keyword
    arguments (default: :func:`schema_of` the function)."""

    fn: Callable[..., Any]
    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.name = self.name or self.fn.__name__
        self.description = self.description or inspect.getdoc(self.fn) or ""
        self.parameters = self.parameters or schema_of(self.fn)

    def spec(self) -> dict[str, Any]:
        """The OpenAI/Hermes function spec (what chat templates render as ``tools``)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def bind(self, call: ToolCall) -> dict[str, Any]:
        """Keyword arguments for ``call``; raises ``ValueError`` naming what is wrong."""
        props = self.parameters.get("properties", {})
        args = dict(call.arguments)
        if call.positional is not None:
            if not props:
                raise ValueError(f"tool '{self.name}' takes no arguments")
            args[next(iter(props))] = call.positional
        unknown = sorted(set(args) - set(props))
        if unknown:
            raise ValueError(
                f"tool '{self.name}' has no argument {unknown[0]!r} (arguments: {', '.join(props) or 'none'})"
            )
        missing = [k for k in self.parameters.get("required", []) if k not in args]
        if missing:
            raise ValueError(f"tool '{self.name}' needs argument {missing[0]!r}")
        return args


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str = "",
    description: str = "",
    parameters: dict[str, Any] | None = None,
) -> Any:
    """Decorator (or function) making a :class:`Tool` of ``fn``."""

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool(fn=f, name=name, description=description, parameters=dict(parameters or {}))

    return wrap(fn) if fn is not None else wrap


def run_with_timeout(
    fn: Callable[..., Any], kwargs: Mapping[str, Any], timeout_s: float | None
) -> tuple[bool, Any, float]:
    """Run ``fn(**kwargs)`` on a daemon thread; ``(ok, result or error message, seconds)``.
    Past ``timeout_s`` the call is abandoned (a Python thread cannot be killed: it keeps
    running in the background) and reported as a timeout."""
    box: list[Any] = []
    done = threading.Event()

    def target() -> None:
        try:
            box.append((True, fn(**kwargs)))
        except SystemExit as exc:  # would end the thread silently: the call then read as a timeout
            box.append((False, f"SystemExit: the tool called sys.exit({text_of(exc.code, repr)})"))
        except BaseException as exc:  # noqa: BLE001 - a tool's bug (whatever it raises) is an observation, not a dead run
            box.append((False, f"{type(exc).__name__}: {text_of(exc)}"))
        finally:
            done.set()

    start = time.perf_counter()
    threading.Thread(target=target, name="geartrain-tool", daemon=True).start()
    if not done.wait(timeout_s):
        return False, f"timed out after {timeout_s}s", time.perf_counter() - start
    ok, value = box[0]
    return ok, value, time.perf_counter() - start


def run_sync(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, or for a coroutine function a function that runs it to completion (on the
    calling thread, in an event loop of its own)."""
    if not inspect.iscoroutinefunction(fn):
        return fn

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        return asyncio.run(fn(*args, **kwargs))

    return run


class _SchemaTool(Tool):
    """A tool whose spec is a given function schema (``get_json_schema``'s, as TRL renders it)."""

    schema: dict[str, Any]

    def __init__(self, fn: Callable[..., Any], schema: dict[str, Any]) -> None:
        function = schema["function"]
        super().__init__(
            fn=fn, name=function["name"], description=function.get("description", ""), parameters=function["parameters"]
        )
        self.schema = schema

    def spec(self) -> dict[str, Any]:
        return self.schema


def tool_of_function(method: Callable[..., Any]) -> Tool:
    """A :class:`Tool` of a plain function or bound method, specified as TRL and
    ``apply_chat_template(tools=[fn])`` specify it: ``transformers.utils.get_json_schema``
    (the docstring's summary, each argument's line of its Google-style ``Args:``) when the
    docstring parses, else the signature alone (:func:`schema_of`) and the whole docstring.
    A coroutine function runs to completion (:func:`run_sync`)."""
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(method)
    except Exception:  # no Google-style docstring: the signature alone, as a geartrain tool
        return Tool(fn=run_sync(method), name=method.__name__, description=inspect.getdoc(method) or "")
    return _SchemaTool(run_sync(method), schema)


def _as_tool(obj: Tool | Callable[..., Any] | str) -> Tool:
    if isinstance(obj, str):
        obj = import_object(obj, what="tool")
    if isinstance(obj, Tool):
        return obj
    if not callable(obj):
        raise GeartrainError(f"a tool must be a function or a geartrain.agents.Tool, got {type(obj).__name__}")
    return tool_of_function(obj)


class ToolEnvironment(Environment):
    """See the module docstring. ``tools``: functions, :class:`Tool`s or dotted paths;
    ``call_format``: ``hermes``, ``compact`` or a :class:`CallFormat`; ``timeout_s``: each
    call's limit; ``max_calls_per_turn``: calls beyond it are errors; ``concurrent_calls``:
    a turn's calls run at once (else in order)."""

    def __init__(
        self,
        tools: Sequence[Tool | Callable[..., Any] | str] = (),
        *,
        call_format: str | CallFormat = "hermes",
        timeout_s: float | None = 10.0,
        max_calls_per_turn: int = 4,
        concurrent_calls: bool = True,
    ) -> None:
        self.registry: dict[str, Tool] = {}
        for t in tools:
            t = _as_tool(t)
            if t.name in self.registry:
                raise GeartrainError(f"two tools are named '{t.name}'")
            if not re.fullmatch(r"[\w.-]+", t.name):  # a lambda's '<lambda>': no call the model writes names it
                raise GeartrainError(
                    f"a tool is named {t.name!r}, which no tool call can name; give a function defined with def, "
                    "or a geartrain.agents.Tool(fn=..., name='...')"
                )
            self.registry[t.name] = t
        self.call_format = get_call_format(call_format)
        self.timeout_s = timeout_s
        self.max_calls_per_turn = max_calls_per_turn
        self.concurrent_calls = concurrent_calls
        """Run a turn's calls at once (each on its own thread); ``False``: one after another,
        in the order the model wrote them (tools that share state, e.g. one object's methods)."""
        self.chat = False
        """Set by the runner when observations are rendered with a chat template."""

    @property
    def stop_texts(self) -> list[str]:  # type: ignore[override]
        """A turn that calls a tool ends with the call (the runner stops generation there),
        or, under a chat template, where the format leaves it to the template's EOS; texts
        set on the environment (a subclass's own) replace these."""
        own = getattr(self, "_own_stop_texts", None)
        if own is not None:
            return list(own)
        accepts_chat = "chat" in inspect.signature(self.call_format.stop_texts).parameters
        return self.call_format.stop_texts(chat=self.chat) if accepts_chat else self.call_format.stop_texts()

    @stop_texts.setter
    def stop_texts(self, texts: Sequence[str]) -> None:
        self._own_stop_texts = list(texts)

    @property
    def tools(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [t.spec() for t in self.registry.values()]

    def reset(self, task: Mapping[str, Any]) -> str:
        return ""

    def _run(self, call: ToolCall) -> ToolOutcome:
        t = self.registry.get(call.name)
        if t is None:
            known = ", ".join(self.registry) or "none"
            return ToolOutcome(name=call.name, ok=False, text=f"unknown tool '{call.name}' (tools: {known})")
        try:
            kwargs = t.bind(call)
        except ValueError as exc:
            return ToolOutcome(name=call.name, ok=False, text=str(exc))
        fn = t.fn

        def as_text(**kw: Any) -> str:  # on the call's thread, within its timeout: a result's str() is the tool's
            return str(fn(**kw))

        ok, value, seconds = run_with_timeout(as_text, kwargs, self.timeout_s)
        return ToolOutcome(name=call.name, ok=ok, text=value, seconds=seconds)

    def step(self, action: str) -> StepResult:
        calls, errors = self.call_format.parse(action)
        if not calls and not errors:
            return StepResult(done=True, info={"tool_calls": 0, "tool_errors": 0, "tool_latencies_s": []})
        outcomes = [ToolOutcome(name="?", ok=False, text=e) for e in errors]
        extra = calls[self.max_calls_per_turn :]
        calls = calls[: self.max_calls_per_turn]
        outcomes += [
            ToolOutcome(name=c.name, ok=False, text=f"more than {self.max_calls_per_turn} calls in one turn")
            for c in extra
        ]
        if len(calls) == 1 or not self.concurrent_calls:
            results = [self._run(c) for c in calls]
        else:  # concurrently: each _run waits on its own thread
            results = [ToolOutcome(name="", ok=False, text="")] * len(calls)
            threads = [
                threading.Thread(target=lambda i=i, c=c: results.__setitem__(i, self._run(c)), daemon=True)
                for i, c in enumerate(calls)
            ]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        outcomes = results + outcomes
        text = self.call_format.results_text(outcomes, chat=self.chat)
        return StepResult(
            observation=text[0] if len(text) == 1 else text,
            info={
                "tool_calls": len(outcomes),
                "tool_errors": sum(not o.ok for o in outcomes),
                "tool_latencies_s": [o.seconds for o in results],
                "calls": [{"name": o.name, "ok": o.ok, "result": o.text[:200]} for o in outcomes],
            },
        )
