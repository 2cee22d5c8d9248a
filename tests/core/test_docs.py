"""The contract, its documentation and its tests cannot drift apart.

- every hook spec has a section in docs/plugins.md;
- every code example marked with a source is a verbatim excerpt of that (tested) file;
- every hook is exercised somewhere in the tests or the conformance suites.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from geartrain import hookspecs

ROOT = Path(__file__).resolve().parents[2]
PLUGINS_DOC = ROOT / "docs" / "plugins.md"
HOOKS = sorted(
    name for name in dir(hookspecs) if getattr(getattr(hookspecs, name), f"{hookspecs.PROJECT_NAME}_spec", None) is not None
)
SOURCED_BLOCK = re.compile(r"<!-- source: (?P<path>[^ ]+) -->\n```[a-z]*\n(?P<code>.*?)```", re.S)


def test_the_spec_has_the_hooks_the_design_names() -> None:
    for required in ("build_model", "shard", "forward_backward", "reshard_for_rollout", "save_checkpoint", "load_checkpoint",
                     "optimizer_step", "offload", "onload", "build_rollout", "generate", "update_weights", "release", "resume"):
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


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_exercised_by_a_test(hook: str) -> None:
    """A hook counts as tested when a test module or a conformance suite calls it, directly
    (``hook.<name>(``) or through the core's handle method that wraps it."""
    facade = {
        "reshard_for_rollout": "sync_weights(",
        "save_checkpoint": "save_checkpoint(",
        "load_checkpoint": "load_checkpoint(",
        "build_model": "Engine(",
        "shard": "Engine(",
        "build_rollout": "Rollout(",
        "data_parallel_coordinates": "engine.dp",
        "capabilities": "capabilities",
        "config_schema": "options",
    }
    needles = {f"hook.{hook}(", f".{hook}(", facade.get(hook, f".{hook}(")}
    sources = [p for p in (ROOT / "tests").rglob("test_*.py") if p.name != "test_docs.py"]
    sources += list((ROOT / "core" / "src" / "geartrain" / "testing").glob("*_suite.py"))
    assert any(any(n in p.read_text() for n in needles) for p in sources), f"no test exercises the '{hook}' hook"
