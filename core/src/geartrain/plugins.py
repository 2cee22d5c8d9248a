"""Plugin discovery, validation and dispatch.

Backends are found through three entry-point groups (``geartrain.engines``,
``geartrain.rollouts``, ``geartrain.extensions``) or registered in code with
:func:`register_engine` / :func:`register_rollout` / :func:`register_extension`.
Loading is lazy (nothing is imported until a backend is asked for or listed) and honours
the ``GEARTRAIN_PLUGINS`` allow-list: unset loads everything, an empty value loads no
entry-point plugin, ``a,b`` loads only those names (a name that no installed plugin has
is warned about once, with the installed names). Code-registered plugins are always
available. A plugin whose import raises :class:`NotImplementedError` (a skeleton) is
reported with its own message and no advice to reinstall it.

:func:`create_manager` builds one :class:`pluggy.PluginManager` per engine or rollout
instance, holding exactly one backend and the extensions asked for.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as importlib_metadata
import inspect
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

import pluggy

from geartrain import hookspecs
from geartrain.errors import PluginError, PluginNotFoundError

PluginKind = Literal["engine", "rollout", "extension"]

logger = logging.getLogger("geartrain.plugins")
_warned_unknown: set[str] = set()

ENTRY_POINT_GROUPS: dict[PluginKind, str] = {
    "engine": "geartrain.engines",
    "rollout": "geartrain.rollouts",
    "extension": "geartrain.extensions",
}
ALLOW_LIST_ENV = "GEARTRAIN_PLUGINS"

REQUIRED_HOOKS: dict[PluginKind, tuple[str, ...]] = {
    "engine": hookspecs.REQUIRED_ENGINE_HOOKS,
    "rollout": hookspecs.REQUIRED_ROLLOUT_HOOKS,
    "extension": (),
}

#: Backends geartrain publishes itself, so a missing one can be named with its pip command.
#: How each of geartrain's own distributions is installed from a checkout of the repository
#: (they are not on PyPI yet): the command an error message names.
CHECKOUT_INSTALL: dict[str, str] = {
    "geartrain": "pip install ./core",
    "geartrain-fsdp": "pip install ./plugins/fsdp_engine",
    "geartrain-megatron": "pip install ./plugins/megatron_engine",
    "geartrain-vllm": "pip install './plugins/vllm_rollout[cpu]'  (on GPUs: [gpu])",
    "geartrain-sglang": "pip install './plugins/sglang_rollout[gpu]'  (CPU: plugins/sglang_rollout/README.md)",
}


def install_hint(distribution: str) -> str:
    """The command that installs one of geartrain's distributions, from the repository root."""
    command = CHECKOUT_INSTALL.get(distribution, f"pip install {distribution}")
    return f"{command}   (the {distribution} package, from the root of a geartrain checkout)"


KNOWN_DISTRIBUTIONS: dict[tuple[PluginKind, str], str] = {
    ("engine", "fsdp"): "geartrain-fsdp",
    ("engine", "megatron"): "geartrain-megatron",
    ("rollout", "vllm"): "geartrain-vllm",
    ("rollout", "sglang"): "geartrain-sglang",
    ("rollout", "torch"): "geartrain",
}


@dataclass(kw_only=True)
class PluginInfo:
    """What ``geartrain plugins`` reports about one plugin."""

    name: str
    kind: PluginKind
    distribution: str | None
    version: str | None
    module: str
    hooks: list[str] = field(default_factory=list)
    capabilities: list[str] = field(default_factory=list)
    source: Literal["entry-point", "registered"] = "entry-point"
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "distribution": self.distribution,
            "version": self.version,
            "module": self.module,
            "hooks": self.hooks,
            "capabilities": self.capabilities,
            "source": self.source,
            "error": self.error,
        }


@dataclass(kw_only=True)
class _Candidate:
    name: str
    kind: PluginKind
    distribution: str | None
    version: str | None
    module: str
    load: Any  # () -> plugin object
    source: Literal["entry-point", "registered"]
    #: other distributions whose entry point of this group has the same name ("dist version
    #: (module)"); such a name is refused, since which one the import system lists last
    #: depends on the order of sys.path and of directory listings
    rivals: tuple[str, ...] = ()


_lock = threading.Lock()
_registered: dict[tuple[PluginKind, str], _Candidate] = {}
_loaded: dict[tuple[PluginKind, str], tuple[object, PluginInfo]] = {}


# ----------------------------------------------------------------------------- registration


def register_engine(name: str, plugin: object, *, distribution: str | None = None, version: str | None = None) -> None:
    """Make ``plugin`` (a module or object with ``@hookimpl`` functions) available as the
    engine backend ``name`` without an entry point (notebooks, tests). It is validated
    now; a :class:`PluginError` says what is wrong."""
    _register("engine", name, plugin, distribution, version)


def register_rollout(name: str, plugin: object, *, distribution: str | None = None, version: str | None = None) -> None:
    """Like :func:`register_engine`, for a rollout backend."""
    _register("rollout", name, plugin, distribution, version)


def register_extension(
    name: str, plugin: object, *, distribution: str | None = None, version: str | None = None
) -> None:
    """Like :func:`register_engine`, for an extension (hook wrappers: timing, tracing...)."""
    _register("extension", name, plugin, distribution, version)


def unregister(kind: PluginKind, name: str) -> None:
    """Forget a plugin registered in code (and any cached load of that name)."""
    with _lock:
        _registered.pop((kind, name), None)
        _loaded.pop((kind, name), None)


def _register(kind: PluginKind, name: str, plugin: object, distribution: str | None, version: str | None) -> None:
    module = getattr(plugin, "__name__", type(plugin).__name__)
    candidate = _Candidate(
        name=name,
        kind=kind,
        distribution=distribution,
        version=version,
        module=module,
        load=lambda: plugin,
        source="registered",
    )
    info = _validate(candidate, plugin)
    with _lock:
        _registered[(kind, name)] = candidate
        _loaded[(kind, name)] = (plugin, info)


# ----------------------------------------------------------------------------- discovery


def _allow_list() -> set[str] | None:
    value = os.environ.get(ALLOW_LIST_ENV)
    if value is None:
        return None
    return {part.strip() for part in value.split(",") if part.strip()}


def _warn_unknown_allowed(allowed: set[str]) -> None:
    """Warn once per name when ``GEARTRAIN_PLUGINS`` names a plugin that is not installed."""
    installed = {
        ep.name for group in ENTRY_POINT_GROUPS.values() for ep in importlib_metadata.entry_points(group=group)
    }
    with _lock:
        installed |= {name for _, name in _registered}
        unknown = sorted(allowed - installed - _warned_unknown)
        _warned_unknown.update(unknown)
    if unknown:
        logger.warning(
            "%s=%r names %s, which %s not installed; installed plugins: %s",
            ALLOW_LIST_ENV,
            os.environ.get(ALLOW_LIST_ENV),
            ", ".join(repr(u) for u in unknown),
            "is" if len(unknown) == 1 else "are",
            ", ".join(sorted(installed)) or "none",
        )


def _entry_point_candidates(kind: PluginKind) -> dict[str, _Candidate]:
    allowed = _allow_list()
    if allowed:
        _warn_unknown_allowed(allowed)
    found: dict[str, _Candidate] = {}
    for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUPS[kind]):
        if allowed is not None and ep.name not in allowed:
            continue
        dist = getattr(ep, "dist", None)
        candidate = _Candidate(
            name=ep.name,
            kind=kind,
            distribution=dist.name if dist is not None else None,
            version=dist.version if dist is not None else None,
            module=ep.value,
            load=ep.load,
            source="entry-point",
        )
        earlier = found.get(ep.name)
        if earlier is not None:
            candidate.rivals = (*earlier.rivals, _described(earlier))
        found[ep.name] = candidate
    return found


def _described(cand: _Candidate) -> str:
    return f"{cand.distribution or 'an unnamed distribution'} {cand.version or '?'} ({cand.module})"


def _candidates(kind: PluginKind) -> dict[str, _Candidate]:
    found = _entry_point_candidates(kind)
    with _lock:
        for (k, name), cand in _registered.items():
            if k == kind:
                found[name] = cand  # code registration wins over an entry point of the same name
    return found


def _new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def _spec_signature(hook_name: str) -> str:
    spec = getattr(hookspecs, hook_name, None)
    if spec is None:
        return hook_name
    params = ", ".join(inspect.signature(spec).parameters)
    return f"{hook_name}({params})"


def _validate(cand: _Candidate, plugin: object) -> PluginInfo:
    """Check ``plugin`` against the hook contract; raise :class:`PluginError` or return its
    :class:`PluginInfo`."""

    def fail(message: str, fix: str) -> PluginError:
        return PluginError(
            message, name=cand.name, kind=cand.kind, distribution=cand.distribution, version=cand.version, fix=fix
        )

    pm = _new_manager()
    try:
        pm.register(plugin, name=f"{cand.kind}:{cand.name}")
    except pluggy.PluginValidationError as exc:
        hook = _hook_name_from_validation_error(exc)
        raise fail(
            f"hook implementation does not match the spec {_spec_signature(hook) if hook else ''}: {exc}",
            "name the hook's arguments as the spec does (an implementation may take fewer, "
            "never others); see docs/plugins.md",
        ) from exc
    unknown = [name for name in _implemented_hooks(plugin) if not hasattr(hookspecs, name) or name.startswith("_")]
    if unknown:
        raise fail(
            f"implements {', '.join(repr(u) for u in unknown)}, which is not a geartrain hook",
            "fix the hook name or remove the @hookimpl marker; the hooks are listed in docs/plugins.md",
        )
    implemented = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
    missing = [h for h in REQUIRED_HOOKS[cand.kind] if h not in implemented]
    if missing:
        raise fail(
            f"does not implement required hook(s): {', '.join(missing)}",
            f"implement them with @geartrain.hookimpl; a {cand.kind} backend needs "
            f"{', '.join(REQUIRED_HOOKS[cand.kind])} (see docs/plugins.md)",
        )
    caps: list[str] = []
    if "capabilities" in implemented:
        try:
            caps = sorted(pm.hook.capabilities() or [])
        except Exception as exc:  # noqa: BLE001 - reported as a plugin problem
            raise fail(
                f"its capabilities() hook raised {type(exc).__name__}: {exc}",
                "make capabilities() return a list of names",
            ) from exc
    return PluginInfo(
        name=cand.name,
        kind=cand.kind,
        distribution=cand.distribution,
        version=cand.version,
        module=cand.module,
        hooks=implemented,
        capabilities=caps,
        source=cand.source,
    )


def _implemented_hooks(plugin: object) -> list[str]:
    names = []
    for attr in dir(plugin):
        try:
            value = getattr(plugin, attr)
        except Exception:  # noqa: BLE001
            continue
        if getattr(value, hookspecs.PROJECT_NAME + "_impl", None) is not None:
            names.append(attr)
    return names


def _hook_name_from_validation_error(exc: Exception) -> str | None:
    text = str(exc)
    for name in dir(hookspecs):
        if f"hook {name!r}" in text or f"hook '{name}'" in text or f"hook {name} " in text:
            return name
    return None


def _load(cand: _Candidate) -> tuple[object, PluginInfo]:
    key = (cand.kind, cand.name)
    with _lock:
        if key in _loaded:
            return _loaded[key]
    if cand.rivals:
        every = [*cand.rivals, _described(cand)]
        raise PluginError(
            f"{len(every)} installed distributions register this name: {'; '.join(every)}; "
            "geartrain does not pick one of them",
            name=cand.name,
            kind=cand.kind,
            fix="uninstall all but one (pip uninstall <distribution>), or register the one to use in code with "
            f"geartrain.register_{cand.kind}('{cand.name}', plugin)",
        )
    try:
        # what a module prints at import goes to stderr: stdout carries the command's own
        # output (`geartrain plugins --json`, `config --json`), which a print would corrupt
        with contextlib.redirect_stdout(sys.stderr):
            plugin = cand.load()
    except NotImplementedError as exc:  # a skeleton says so itself; reinstalling would not help
        raise PluginError(
            f"not implemented: {exc}",
            name=cand.name,
            kind=cand.kind,
            distribution=cand.distribution,
            version=cand.version,
            fix=f"leave it out with {ALLOW_LIST_ENV}=<names to load>"
            + (f", or uninstall it (pip uninstall {cand.distribution})" if cand.distribution else ""),
        ) from exc
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any import failure is the plugin's problem
        # SystemExit too: a module that parses arguments or calls sys.exit at import would
        # otherwise end `geartrain plugins` or a job with no word at all
        raise PluginError(
            f"failed to import {cand.module}: {type(exc).__name__}: {exc}",
            name=cand.name,
            kind=cand.kind,
            distribution=cand.distribution,
            version=cand.version,
            fix=_import_fix(exc, cand.distribution),
        ) from exc
    info = _validate(cand, plugin)
    with _lock:
        _loaded[key] = (plugin, info)
    return plugin, info


def _import_fix(exc: BaseException, distribution: str | None) -> str:
    """What to do about a plugin whose module failed to import with ``exc``: a missing
    module is a dependency to install; code that does not parse, or that raises as it runs,
    is the plugin's bug (or written for another Python), which reinstalling does not mend."""
    dist = distribution or "the distribution that provides it"
    leave_out = f"or leave it out with {ALLOW_LIST_ENV}=<names to load>"
    if isinstance(exc, ImportError):
        return f"install its missing dependencies or reinstall it (pip install --force-reinstall {dist}); {leave_out}"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    what = f"its code does not parse on Python {python}" if isinstance(exc, SyntaxError) else "its module raised"
    return (
        f"{what}: a bug in the plugin, or code for another Python or geartrain version; upgrade it "
        f"(pip install --upgrade {dist}) or tell its authors; {leave_out}"
    )


def load_plugin(kind: PluginKind, name: str) -> tuple[object, PluginInfo]:
    """Import and validate one plugin by name; raise :class:`PluginNotFoundError` (listing
    what is installed and how to add it) or :class:`PluginError`."""
    candidates = _candidates(kind)
    if name not in candidates:
        raise PluginNotFoundError(_not_found_message(kind, name, candidates))
    return _load(candidates[name])


def _not_found_message(kind: PluginKind, name: str, candidates: dict[str, _Candidate]) -> str:
    installed = (
        ", ".join(
            f"{c.name} ({c.distribution or c.source} {c.version or ''})".replace(" )", ")") for c in candidates.values()
        )
        or "none"
    )
    lines = [f"no {kind} named '{name}'. Installed {kind}s: {installed}."]
    allowed = _allow_list()
    if allowed is not None and name not in allowed:
        lines.append(f"{ALLOW_LIST_ENV}={os.environ.get(ALLOW_LIST_ENV)!r} does not allow it: add '{name}' to it.")
        if any(ep.name == name for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUPS[kind])):
            return "\n".join(lines)  # installed: an install command would only mislead
    dist = KNOWN_DISTRIBUTIONS.get((kind, name))
    if dist:
        lines.append(f"Install it with: {install_hint(dist)}")
    else:
        lines.append(
            f"Install the package that provides the '{name}' {kind} (entry-point group "
            f"{ENTRY_POINT_GROUPS[kind]}), or register it in code with geartrain.register_{kind}('{name}', plugin)."
        )
    return "\n".join(lines)


def list_plugins() -> list[PluginInfo]:
    """Every plugin that is installed (and allowed) or registered, loaded and validated.
    A broken plugin is listed with its ``error``; it does not stop the others."""
    infos: list[PluginInfo] = []
    for kind in ENTRY_POINT_GROUPS:
        for cand in _candidates(kind).values():
            try:
                _, info = _load(cand)
            except PluginError as exc:
                info = PluginInfo(
                    name=cand.name,
                    kind=kind,
                    distribution=cand.distribution,
                    version=cand.version,
                    module=cand.module,
                    source=cand.source,
                    error=str(exc),
                )
            infos.append(info)
    return infos


def create_manager(
    kind: Literal["engine", "rollout"], name: str, extensions: list[str] | tuple[str, ...] = ()
) -> pluggy.PluginManager:
    """A fresh :class:`pluggy.PluginManager` holding the backend ``name`` of ``kind`` and
    the named extensions, validated (``check_pending``)."""
    plugin, _ = load_plugin(kind, name)
    pm = _new_manager()
    pm.register(plugin, name=f"{kind}:{name}")
    for ext_name in extensions:
        ext, _ = load_plugin("extension", ext_name)
        pm.register(ext, name=f"extension:{ext_name}")
    pm.check_pending()
    return pm


def backend_info(kind: PluginKind, name: str) -> PluginInfo:
    """The validated :class:`PluginInfo` of one backend (loads it if needed)."""
    return load_plugin(kind, name)[1]


def clear_cache() -> None:
    """Forget loaded entry-point plugins (tests that install/uninstall packages use it)."""
    with _lock:
        for key in [k for k, c in _loaded.items() if (k not in _registered)]:
            _loaded.pop(key, None)
        _warned_unknown.clear()
    importlib_metadata_cache_clear()


def importlib_metadata_cache_clear() -> None:
    import importlib

    importlib.invalidate_caches()
