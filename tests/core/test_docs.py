"""The contract, its documentation and its tests cannot drift apart.

- every hook spec has a section in docs/plugins.md;
- every code example marked with a source is a verbatim excerpt of that (tested) file;
- every hook has its own test, named ``test_hook_<hook>`` (datasette's rule), that reaches it.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest
from geartrain import hookspecs

ROOT = Path(__file__).resolve().parents[2]
PLUGINS_DOC = ROOT / "docs" / "plugins.md"
HOOKS = sorted(
    name
    for name in dir(hookspecs)
    if getattr(getattr(hookspecs, name), f"{hookspecs.PROJECT_NAME}_spec", None) is not None
)
SOURCED_BLOCK = re.compile(r"<!-- source: (?P<path>[^ ]+) -->\n```[a-z]*\n(?P<code>.*?)```", re.S)


def test_the_spec_has_the_hooks_the_design_names() -> None:
    for required in (
        "build_model",
        "shard",
        "forward_backward",
        "reshard_for_rollout",
        "save_checkpoint",
        "load_checkpoint",
        "optimizer_step",
        "offload",
        "onload",
        "build_rollout",
        "generate",
        "update_weights",
        "release",
        "resume",
    ):
        assert required in HOOKS


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_has_a_documented_section(hook: str) -> None:
    assert f"### `{hook}`" in PLUGINS_DOC.read_text(), f"docs/plugins.md has no section for the '{hook}' hook"


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_spec_states_its_contract(hook: str) -> None:
    doc = getattr(hookspecs, hook).__doc__ or ""
    assert len(doc.split()) >= 15, f"the '{hook}' spec needs a docstring that states its contract"


def test_sourced_examples_are_verbatim_excerpts_of_tested_code() -> None:
    blocks = list(SOURCED_BLOCK.finditer(PLUGINS_DOC.read_text()))
    assert len(blocks) >= len(HOOKS)
    for block in blocks:
        source = (ROOT / block["path"]).read_text()
        code = textwrap.dedent(block["code"]).strip()
        assert code in source, f"docs/plugins.md example no longer matches {block['path']}:\n{code[:200]}"


#: How a test reaches a hook when it does not call ``hook.<name>(`` itself: the core's
#: handle method (or attribute) that wraps it.
FACADE = {
    "build_model": "Engine",
    "shard": "Engine",
    "data_parallel_coordinates": "dp",
    "reshard_for_rollout": "sync_weights",
    "build_rollout": "Rollout",
    "capabilities": "capabilities",
    "config_schema": "options",
    "export_hf": "export_hf",
}
HOOK_TEST = re.compile(r"^test_hook_(?P<rest>\w+)$")


def _hook_tests() -> dict[str, list[tuple[Path, str, set[str]]]]:
    """Every test function named ``test_hook_<hook>[_what]`` under tests/, with the names its
    body uses (attributes, names, words of code it runs as a script), following the
    module-level helpers it refers to, also those imported from a sibling module."""
    found: dict[str, list[tuple[Path, str, set[str]]]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        defs: dict[str, ast.AST] = {}
        for node in tree.body:  # helpers imported from sibling modules (from .common import x)
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                sibling = ast.parse((path.parent / f"{node.module}.py").read_text())
                names = {a.name for a in node.names}
                defs.update(
                    {
                        n.name: n
                        for n in sibling.body
                        if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names
                    }
                )
        defs.update({n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))})
        defs.update(
            {t.id: n for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        )
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or not (m := HOOK_TEST.match(node.name)):
                continue
            hook = max((h for h in HOOKS if m["rest"] == h or m["rest"].startswith(h + "_")), key=len, default=None)
            used: set[str] = set()
            todo, seen = [node], set()
            while todo:
                current = todo.pop()
                for sub in ast.walk(current):
                    name = (
                        sub.attr
                        if isinstance(sub, ast.Attribute)
                        else sub.id
                        if isinstance(sub, ast.Name)
                        else sub.name
                        if isinstance(sub, ast.FunctionDef)
                        else None
                    )
                    if isinstance(sub, ast.Constant) and isinstance(sub.value, str):  # code run as a script
                        used.update(re.findall(r"\w+", sub.value))
                    if name is None:
                        continue
                    used.add(name)
                    if name in defs and name not in seen:
                        seen.add(name)
                        todo.append(defs[name])
            found.setdefault(hook or f"<unknown: {node.name}>", []).append((path, node.name, used))
    return found


HOOK_TESTS = _hook_tests()


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_has_its_own_named_test(hook: str) -> None:
    """datasette's rule: each hook has a test named ``test_hook_<hook>`` (or
    ``test_hook_<hook>_<what>``) in tests/, and that test reaches the hook (calls it, or the
    core's method that wraps it)."""
    tests = HOOK_TESTS.get(hook)
    assert tests, f"no test is named test_hook_{hook}[_...] under tests/"
    needles = {hook, FACADE.get(hook, hook)}
    for path, name, used in tests:
        assert needles & used, f"{path.name}::{name} never reaches the '{hook}' hook (uses none of {sorted(needles)})"


def test_every_hook_test_names_a_hook() -> None:
    unknown = sorted(k for k in HOOK_TESTS if k not in HOOKS)
    assert not unknown, f"tests named test_hook_* for hooks that do not exist: {unknown}"


SUITES = sorted((ROOT / "core" / "src" / "geartrain" / "testing").glob("*_suite.py"))
TOLERANCE_KEYWORDS = {"atol", "rtol", "abs", "rel"}


@pytest.mark.parametrize("suite", SUITES, ids=lambda p: p.stem)
def test_every_conformance_tolerance_is_a_documented_class_attribute(suite: Path) -> None:
    """A suite compares with its class attributes (``logprob_atol``...), never a literal a
    backend cannot change; each attribute has a docstring, is used, and is in the docs."""
    source = suite.read_text()
    tree = ast.parse(source)
    literal = [
        (node.arg, ast.unparse(node.value), node.value.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.keyword)
        and node.arg in TOLERANCE_KEYWORDS
        and isinstance(node.value, ast.Constant)
        and node.value.value != 0
    ]
    assert not literal, f"{suite.name} compares with literal tolerances {literal}: use a documented class attribute"
    suite_class = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Conformance"))
    body = suite_class.body
    tolerances = [
        (i, n.target.id)
        for i, n in enumerate(body)
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id.endswith("_atol")
    ]
    assert tolerances, f"{suite.name} declares no tolerance"
    docs = PLUGINS_DOC.read_text()
    for i, name in tolerances:
        following = body[i + 1] if i + 1 < len(body) else None
        assert isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant), f"{name} has no docstring"
        assert f"self.{name}" in source, f"{suite.name} declares {name} but never uses it"
        assert f"`{name}`" in docs, f"docs/plugins.md does not list the tolerance {name}"


def _sentences(text: str) -> list[str]:
    flat = re.sub(r"\s+", " ", text)
    return [s.strip() for s in re.split(r"(?<=[.;:])\s", flat) if s.strip()]


def test_one_rule_for_metric_reduction_the_core_sums_over_data_parallel_ranks() -> None:
    """Engines return their own slice's metrics; the core sums them over the data-parallel
    ranks (``geartrain.cluster.reduce``). A sentence anywhere in the docs that tells an
    engine to reduce them itself (an author following it would report dp x the loss) fails
    this test: every sentence about reducing metrics over ranks must say the core does it,
    or that the engine never does."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("plugins/*/README.md"))]
    docs += sorted((ROOT / "core" / "src").rglob("*.py")) + sorted(ROOT.glob("plugins/*/src/**/*.py"))
    offending = []
    for path in docs:
        for sentence in _sentences(path.read_text(encoding="utf-8")):
            lower = sentence.lower()
            if (
                "metric" not in lower
                or not re.search(r"\breduc\w*", lower)
                or not re.search(r"data-parallel|ranks", lower)
            ):
                continue
            if not re.search(r"\bengines?\b|\bbackends?\b|\bhooks?\b|\byour\b", lower):
                continue  # about the core's own reduction (cluster.reduce, dispatch), not an engine's
            if not re.search(r"\bcore\b|\bnever\b|cluster\.reduce|engine\.forward_backward", lower):
                offending.append(f"{path.relative_to(ROOT)}: {sentence}")
    assert not offending, "sentences telling engines to reduce metrics themselves:\n" + "\n".join(offending)
