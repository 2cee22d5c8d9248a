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


# ----------------------------------------------------------------------------- every code block (issue 34)
#
# Every fenced block in docs/*.md is one of these kinds, each checked here:
#   - a verbatim excerpt of a tested file: preceded by ``<!-- source: path -->``;
#   - ``python``: executed, the blocks of a page in order in one namespace (as a reader
#     pastes them), in a fresh working directory. ``<!-- docs-test: imports-only (why) -->``
#     before a block that trains runs only its imports and compiles the rest;
#     ``<!-- docs-test: compile-only (why) -->`` (another library's code, shown for
#     comparison) compiles it;
#   - ``toml``: parsed and validated against the job schema (``TrainConfig``), as a job file's
#     sections;
#   - ``console``: commands (the ``$ `` lines, or every line when none has one): each names
#     an existing ``geartrain`` command, ``make`` target or file; other lines are output;
#   - ``text``: output or a diagram, not code; with ``<!-- files: dir -->`` before it, every
#     path of a file tree it draws exists under ``dir``.

DOCS = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(
    r"(?P<marker>(?:<!--[^\n]*-->\n)?)^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^(?P=indent)```",
    re.S | re.M,
)
KINDS = {"python", "toml", "console", "text"}


def _blocks(path: Path) -> list[tuple[int, str, str, str]]:
    """``(line, kind, marker, code)`` of each fenced block of ``path``; a sourced block's
    kind is ``source``."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        line = text[: m.start("indent")].count("\n") + 1
        kind = "source" if m["marker"].startswith("<!-- source:") else m["lang"]
        out.append((line, kind, m["marker"].strip(), textwrap.dedent(m["code"])))
    return out


BLOCKS = [(path, *block) for path in DOCS for block in _blocks(path)]


def _ids(path: Path, line: int) -> str:
    return f"{path.name}:{line}"


def test_every_docs_block_says_what_kind_it_is() -> None:
    unknown = [f"{_ids(path, line)} ```{kind}" for path, line, kind, _, _ in BLOCKS if kind not in KINDS | {"source"}]
    assert not unknown, (
        "docs blocks of no checked kind (tag each python, toml, console or text, or mark it "
        f"<!-- source: path -->): {unknown}"
    )


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_sourced_block_is_a_verbatim_excerpt(path: Path) -> None:
    for line, kind, marker, code in _blocks(path):
        if kind != "source":
            continue
        source = (ROOT / marker.removeprefix("<!-- source:").removesuffix("-->").strip()).read_text()
        assert code.strip() in source, f"{_ids(path, line)} no longer matches {marker}:\n{code[:200]}"


PYTHON_PAGES = sorted({path for path, _, kind, _, _ in BLOCKS if kind == "python"})


@pytest.mark.parametrize("path", PYTHON_PAGES, ids=lambda p: p.name)
def test_every_python_block_runs(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": f"docs_{path.stem}"}
    for line, kind, marker, code in _blocks(path):
        if kind != "python":
            continue
        compiled = compile(code, f"{path.name}:{line}", "exec")
        if marker.startswith("<!-- docs-test: compile-only ("):
            continue
        if marker.startswith("<!-- docs-test: imports-only ("):
            tree = ast.parse(code)
            imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
            compiled = compile(ast.Module(body=imports, type_ignores=[]), f"{path.name}:{line}", "exec")
        else:
            assert not marker, f"{_ids(path, line)}: unknown marker {marker}"
        try:
            exec(compiled, namespace)  # noqa: S102 - the docs' own example
        except Exception as exc:
            raise AssertionError(f"{_ids(path, line)}: the example raises {type(exc).__name__}: {exc}") from exc


TOML_BLOCKS = [(path, line, code) for path, line, kind, _, code in BLOCKS if kind == "toml"]


@pytest.mark.parametrize(("path", "line", "code"), TOML_BLOCKS, ids=[_ids(p, n) for p, n, _ in TOML_BLOCKS])
def test_every_toml_block_is_a_valid_job_section(path: Path, line: int, code: str) -> None:
    import tomllib

    from geartrain.trainer.config import TrainConfig

    data = tomllib.loads(code)
    if "model" not in data:  # a fragment: the sections it shows, on a job that names a model
        data["model"] = {"tiny": "qwen2"}
    TrainConfig.model_validate(data)


def _make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w.-]*):", (ROOT / "Makefile").read_text(), re.M))


def _cli_commands() -> set[str]:
    from geartrain.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")  # noqa: SLF001 - argparse keeps them here
    return set(sub.choices)


#: Programs a console block may run besides geartrain, make and python: installers and runners.
OTHER_PROGRAMS = {"pip", "pytest", "ray", "uv", "huggingface-cli"}

CONSOLE_BLOCKS = [(path, line, code) for path, line, kind, _, code in BLOCKS if kind == "console"]


@pytest.mark.parametrize(("path", "line", "code"), CONSOLE_BLOCKS, ids=[_ids(p, n) for p, n, _ in CONSOLE_BLOCKS])
def test_every_console_command_exists(path: Path, line: int, code: str) -> None:
    lines = code.splitlines()
    prompted = [x[2:] for x in lines if x.startswith("$ ")]
    commands = [c.split("#", 1)[0].split() for c in (prompted or lines)]
    for words in filter(None, commands):
        program, args = words[0], words[1:]
        where = f"{_ids(path, line)}: {' '.join(words)}"
        if program == "geartrain":
            assert args and args[0] in _cli_commands(), f"{where}: no such geartrain command"
        elif program == "make":
            assert args and all(a in _make_targets() for a in args if "=" not in a), f"{where}: no such make target"
        elif program == "python":
            script = next(a for a in args if not a.startswith("-"))
            assert (ROOT / script).is_file(), f"{where}: no such file"
        else:
            assert program in OTHER_PROGRAMS, f"{where}: not a command this test knows"


TREE_BLOCKS = [
    (path, line, marker, code) for path, line, kind, marker, code in BLOCKS if marker.startswith("<!-- files:")
]


@pytest.mark.parametrize(
    ("path", "line", "marker", "code"), TREE_BLOCKS, ids=[_ids(p, n) for p, n, _, _ in TREE_BLOCKS]
)
def test_every_file_tree_names_existing_files(path: Path, line: int, marker: str, code: str) -> None:
    base = ROOT / marker.removeprefix("<!-- files:").removesuffix("-->").strip()
    entries = [x.split("──", 1)[1].strip() for x in code.splitlines() if "──" in x]
    assert entries
    for entry in entries:
        assert (base / entry).exists(), f"{_ids(path, line)}: {entry} is not in {base.relative_to(ROOT)}"


def test_the_episodes_log_sample_is_what_the_trainer_writes(tmp_path: Path) -> None:
    """docs/agents.md's episodes.log sample, rendered from the episode it shows."""
    from geartrain.batch import Batch
    from geartrain.trainer.episodes import log_sample

    (line, _, _, code), *_ = [b for b in _blocks(ROOT / "docs" / "agents.md") if b[3].startswith("--- step ")]
    step = int(re.match(r"--- step (\d+):", code)[1])
    shown = dict(re.findall(r"^\[(\w+)\] (.*)$", code, re.M))
    turns = [
        {"role": "model" if tag == "model" else "observation", "text": ast.literal_eval(text)}
        for tag, text in re.findall(r"^\[(model|obs)\] (.*)$", code, re.M)
    ]
    prompt, truth = re.match(r"(.*)  \(ground truth (.*)\)$", shown["task"]).groups()
    record = {"turns": turns, "finish": shown["end"], "truncated": False, "error": None}
    batch = Batch(
        {}, meta={"episode": [record], "prompt": [ast.literal_eval(prompt)], "ground_truth": [ast.literal_eval(truth)]}
    )
    assert log_sample(batch, tmp_path, step) == code, f"agents.md:{line}"


# ----------------------------------------------------------------------------- item 17


def test_every_capability_is_in_the_capabilities_table() -> None:
    from geartrain.types import Capability

    docs = PLUGINS_DOC.read_text()
    names = {k: v for k, v in vars(Capability).items() if k.isupper()}
    missing = [f"{k} ({v})" for k, v in names.items() if f"| `{k}` (`{v}`) |" not in docs]
    assert not missing, f"docs/plugins.md's capabilities table lacks {missing}"


def test_architecture_lists_every_core_module_a_plugin_imports() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    listed = set(
        re.findall(
            r"`(geartrain(?:\.\w+)?)`",
            text.split("plugins import only the core's public modules", 1)[1].split(").", 1)[0],
        )
    )
    sources = [*ROOT.glob("plugins/*/src/**/*.py"), *ROOT.glob("tests/third_party_plugin/src/**/*.py")]
    imported: dict[str, str] = {}
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if name.split(".")[0] == "geartrain":
                    imported.setdefault(".".join(name.split(".")[:2]), str(source.relative_to(ROOT)))
    unlisted = {m: f for m, f in imported.items() if m not in listed}
    assert not unlisted, f"docs/architecture.md does not list the core modules plugins import: {unlisted}"
