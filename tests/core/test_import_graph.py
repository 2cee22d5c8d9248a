"""The core's modules, and each plugin's, import each other without a circle.

The graph has an edge ``a -> b`` for every ``import`` of ``b`` written in ``a``: at the top,
inside functions and under ``TYPE_CHECKING`` alike (a deferred import is still a dependency,
only a hidden one). ``from pkg import name`` points at ``pkg.name`` when that is a module,
else at ``pkg`` itself. The implicit import of a module's parent package is not an edge
(every package ``__init__`` re-exports its children).
"""

from __future__ import annotations

import ast
from pathlib import Path

import geartrain

ROOT = Path(geartrain.__file__).parent


def module_files(root: Path = ROOT, package: str = "geartrain") -> dict[str, Path]:
    files = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join([package, *parts])] = path
    return files


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")
                    anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                while target and target not in files and "." in target:
                    target = target.rsplit(".", 1)[0]  # `import geartrain.x.y` names geartrain.x.y
                if target in files and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_graph_sees_real_edges() -> None:
    graph = import_graph(module_files())
    assert "geartrain.types" in graph["geartrain.hookspecs"]
    assert "geartrain.plugins" in graph["geartrain.engine"]  # `from geartrain import plugins`


def test_the_cycle_finder_finds_a_planted_circle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n")
    cycle = find_cycle(import_graph(module_files(pkg, "pkg")))
    assert cycle == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]


def test_the_core_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph(module_files()))
    assert cycle is None, "import circle in the core: " + " -> ".join(cycle or [])


PLUGIN_PACKAGES = sorted(
    path for path in (ROOT.parents[2] / "plugins").glob("*/src/*") if (path / "__init__.py").is_file()
)


def test_every_plugin_package_is_found() -> None:
    names = {path.name for path in PLUGIN_PACKAGES}
    assert {"geartrain_fsdp", "geartrain_megatron", "geartrain_vllm", "geartrain_sglang"} <= names, names


def test_no_plugin_has_an_import_cycle() -> None:
    """The same rule for every plugin under plugins/ (read from source: a plugin's
    dependencies need not be installed here). Megatron's optim.py once imported the
    engine's model type while engine.py imported optim.py."""
    cycles = {}
    for path in PLUGIN_PACKAGES:
        cycle = find_cycle(import_graph(module_files(path, path.name)))
        if cycle is not None:
            cycles[path.name] = " -> ".join(cycle)
    assert not cycles, f"import circles in plugins: {cycles}"
