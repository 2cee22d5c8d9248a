"""Checking a parsed configuration against the installed plugins: the step after parsing.

:mod:`geartrain.config` parses and validates sections without loading any plugin; this
module then checks each engine/rollout section against its backend (it exists and loads,
its declared capabilities cover what the section asks for, ``options`` match the backend's
``config_schema``). Plugins may import :mod:`geartrain.config`; the config never imports
plugins, so the core has no import circle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from geartrain import plugins
from geartrain.config import (
    ConfigT,
    EngineConfig,
    RolloutConfig,
    iter_backend_sections,
    parse_config,
    validation_problems,
)
from geartrain.errors import ConfigError, GeartrainError

__all__ = ["capability_problems", "check_backends", "load_config", "validate_backend_sections"]


def load_config(
    schema: type[ConfigT],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    defaults: Mapping[str, Any] | None = None,
    check_plugins: bool = True,
) -> ConfigT:
    """Read ``path`` (if given) over ``defaults``, apply ``overrides``, validate, and (with
    ``check_plugins``) check every backend section against its installed plugin. Raises
    :class:`ConfigError` listing every problem with its path."""
    config = parse_config(schema, path, overrides, defaults=defaults)
    return check_backends(config, str(path) if path else None) if check_plugins else config


def check_backends(config: ConfigT, source: str | None = None) -> ConfigT:
    """Check every engine/rollout section of a parsed ``config`` against its backend
    (:func:`validate_backend_sections`); raise one :class:`ConfigError` with all problems.
    Returns ``config``, its ``options`` replaced by the backends' validated models."""
    problems = validate_backend_sections(config)
    if problems:
        raise ConfigError(problems, source)
    return config


def validate_backend_sections(config: BaseModel) -> list[tuple[str, str]]:
    """Check each engine/rollout section (of a job: only those of the roles it builds, its
    ``backend_sections()``): the backend exists and loads, its declared
    capabilities cover what the section asks for, and ``options`` match its schema
    (``options`` is replaced by the validated model). Returns the problems."""
    problems: list[tuple[str, str]] = []
    # a job config names the sections of the roles it builds; other trees: every section
    built = getattr(config, "backend_sections", None)
    for path, section in built() if callable(built) else iter_backend_sections(config):
        kind = "engine" if isinstance(section, EngineConfig) else "rollout"
        try:
            pm = plugins.create_manager(kind, section.backend, section.extensions)
            info = plugins.backend_info(kind, section.backend)
        except GeartrainError as exc:
            problems.append((f"{path}.backend", str(exc)))
            continue
        problems += [(f"{path}.{p}", m) for p, m in capability_problems(section, set(info.capabilities))]
        engine_needs = getattr(config, "engine_needs", None)
        if kind == "engine" and callable(engine_needs):
            for section_path, key, cap in engine_needs():
                if section_path == path and cap not in info.capabilities:
                    able = sorted(
                        i.name for i in plugins.list_plugins() if i.kind == "engine" and cap in i.capabilities
                    )
                    problems.append(
                        (
                            key,
                            f"needs the '{section.backend}' engine ({path}) to declare '{cap}', which it does not; "
                            f"engines that do: {', '.join(able) or 'none installed'}",
                        )
                    )
        needs = getattr(config, "rollout_needs", None)
        if kind == "rollout" and callable(needs):
            for key, cap in needs():
                if cap not in info.capabilities:
                    able = sorted(
                        i.name for i in plugins.list_plugins() if i.kind == "rollout" and cap in i.capabilities
                    )
                    where = (
                        f"rollouts that have it: {', '.join(able)}"
                        if able
                        else "vllm's rollout has it (geartrain-vllm)"
                    )
                    problems.append(
                        (
                            key,
                            f"the '{section.backend}' rollout has no {cap} (it does not declare "
                            f"'{cap}'); {where}; or leave {key} at its default",
                        )
                    )
        schema = pm.hook.config_schema()
        raw = section.options
        if isinstance(raw, BaseModel):
            raw = raw.model_dump()
        if schema is None:
            if raw:
                problems.append(
                    (f"{path}.options", f"the '{section.backend}' {kind} takes no options, got {sorted(raw)}")
                )
            continue
        try:
            object.__setattr__(section, "options", schema.model_validate(raw or {}))
        except ValidationError as exc:
            problems += validation_problems(exc, f"{path}.options")
    return problems


def capability_problems(section: EngineConfig | RolloutConfig, capabilities: set[str]) -> list[tuple[str, str]]:
    """What ``section`` asks for that a backend with ``capabilities`` cannot do."""
    problems = []
    if isinstance(section, EngineConfig):
        wanted = {
            "parallel.dp": ("data_parallel", section.parallel.dp > 1),
            "parallel.sp": ("sequence_parallel", section.parallel.sp > 1),
            "parallel.tp": ("tensor_parallel", section.parallel.tp > 1),
            "parallel.pp": ("pipeline_parallel", section.parallel.pp > 1),
        }
        for field_path, (cap, asked) in wanted.items():
            if asked and cap not in capabilities:
                problems.append((field_path, f"the '{section.backend}' engine does not declare '{cap}'"))
        if section.lora is not None and "lora" not in capabilities:
            problems.append(("lora", _no_lora("engine", section.backend)))
    elif section.max_lora_rank is not None and "lora" not in capabilities:
        problems.append(("max_lora_rank", _no_lora("rollout", section.backend) + " (or actor.lora.sync = 'merged')"))
    return problems


def _no_lora(kind: plugins.PluginKind, backend: str) -> str:
    """Why ``backend`` cannot take LoRA adapters, and where to go instead."""
    message = f"the '{backend}' {kind} does not support LoRA adapters (it does not declare 'lora')"
    if kind == "engine":
        return message + "; LoRA runs on the 'fsdp' engine (geartrain-fsdp): set actor.engine.backend = \"fsdp\""
    able = sorted(i.name for i in plugins.list_plugins() if i.kind == kind and "lora" in i.capabilities)
    return message + (f"; rollouts that do: {', '.join(able)}" if able else "")
