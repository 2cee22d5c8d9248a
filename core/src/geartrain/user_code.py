"""Loading a user's object named in a job file: ``path/to/file.py:Name`` (relative to the job
file's directory) or a dotted path ``package.module:Name``. Reward functions and agent
environments are both named this way."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from geartrain.errors import GeartrainError

__all__ = ["import_object", "is_file_spec", "load_from_file"]


def is_file_spec(spec: str) -> bool:
    """Whether ``spec`` names an object in a Python file (``file.py:Name``)."""
    return ".py:" in spec


def load_from_file(spec: str, base_dir: str | None, *, what: str, key: str) -> Any:
    """The object ``Name`` of ``file.py:Name``, the file resolved against ``base_dir`` when
    relative. ``what`` ("reward function", "environment") and ``key`` (the config key)
    name the spec in the error raised when the file or the name is missing, or when
    importing the file raises (one line: the exception and the file's line it came from).

    The file's directory is put on ``sys.path`` (once, at its end) before the import, so a
    module next to it (``from my_helpers import ...``) imports, as it does when the file is
    run as a script."""
    file, _, name = spec.rpartition(":")
    path = Path(os.path.expanduser(file))
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if not path.is_file():
        raise GeartrainError(f"{what} file '{path}' does not exist ({key} = '{spec}')")
    module_name = f"geartrain_user_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    directory = str(path.resolve().parent)
    if directory not in sys.path:
        sys.path.append(directory)
    # Registered while it runs: a @dataclass (or typing.get_type_hints) with string
    # annotations looks its module up in sys.modules. Removed after: the module cannot be
    # imported by name elsewhere, so Ray's cloudpickle sends its functions by value.
    previous = sys.modules.get(module_name)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # the user's code: one line naming the file and line, not a traceback
        raise GeartrainError(
            f"{what} file '{path}' failed to import{_where(exc, path)}: {type(exc).__name__}: {exc} ({key} = '{spec}')"
        ) from exc
    finally:
        if previous is None:
            sys.modules.pop(module_name, None)
        else:
            sys.modules[module_name] = previous
    _siblings_imported_as_such(path, what)
    if not hasattr(module, name):
        raise GeartrainError(
            f"{what} file '{path}' has no {'function' if what.endswith('function') else 'attribute'} '{name}'"
        )
    return getattr(module, name)


def _siblings_imported_as_such(path: Path, what: str) -> None:
    """Raise :class:`GeartrainError` when a module ``path`` imports by a name it has a file of
    beside it (``import helpers`` next to ``helpers.py``) came from elsewhere: one process
    holds one module of a name, so two user files each importing its own ``helpers`` both got
    the first one imported (the second reward scored with the first's helpers, silently)."""
    import ast

    directory = path.resolve().parent
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {
        n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level
    }
    for name in sorted(names - {path.stem}):  # a file importing its own name means another module
        sibling = directory / f"{name}.py" if (directory / f"{name}.py").is_file() else directory / name
        if not (sibling.suffix == ".py" or (sibling / "__init__.py").is_file()):
            continue
        loaded = getattr(sys.modules.get(name), "__file__", None)
        if loaded is not None and not Path(loaded).resolve().is_relative_to(directory):
            raise GeartrainError(
                f"{what} file '{path}' imports '{name}', meant as its sibling {sibling}, but the process already "
                f"holds another module of that name ({loaded}, imported first); one process has one module per "
                "name: rename one of the two"
            )


def _where(exc: BaseException, path: Path) -> str:
    """`` (line N)`` of ``path``'s last frame in ``exc``'s traceback (a ``SyntaxError``'s
    own line), or ``""``."""
    if isinstance(exc, SyntaxError) and exc.lineno is not None and exc.filename == str(path):
        return f" (line {exc.lineno})"
    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(path)]
    return f" (line {lines[-1]})" if lines and lines[-1] is not None else ""


def import_object(path: str, *, what: str) -> Any:
    """``package.module:attr`` (or ``package.module.attr``) imported on demand."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise GeartrainError(f"{what} path '{path}' must look like 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise GeartrainError(f"{what} '{path}': cannot import module '{module_name}': {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise GeartrainError(f"{what} '{path}': module '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    return obj
