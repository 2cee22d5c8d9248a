"""Source guard: nothing under ``core/src`` or ``plugins/*/src`` reads a pickle with
``pickle.load``/``pickle.loads``, ``from pickle import load``, ``allow_pickle=True`` or
``torch.load(..., weights_only=False)`` (README: geartrain never unpickles code; the wire
and the test spawner carry JSON and weights-only ``torch.save`` files). The allow-listed
readers (``geartrain.dcp_guard``'s unpickler, ``weights_only=True``) are not matched."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = re.compile(
    r"pickle\.loads?\b|from\s+pickle\s+import\s+[^\n]*\bloads?\b|allow_pickle\s*=\s*True|weights_only\s*=\s*False"
)


def offending_lines(roots: list[Path], base: Path = ROOT) -> list[str]:
    """``path:line: text`` (``path`` relative to ``base``) of every line of the ``*.py``
    files under ``roots`` that reads a pickle unchecked."""
    hits = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if FORBIDDEN.search(line):
                    hits.append(f"{path.relative_to(base)}:{number}: {line.strip()}")
    return hits


def test_no_source_file_unpickles_without_an_allow_list() -> None:
    roots = [ROOT / "core" / "src", *sorted((ROOT / "plugins").glob("*/src"))]
    assert len(roots) >= 5 and all(r.is_dir() for r in roots), roots  # the core and its four plugins
    assert offending_lines(roots) == []


def test_the_guard_sees_each_form(tmp_path: Path) -> None:
    planted = ["pickle.loads(data)", "pickle.load(f)", "from pickle import dumps, loads",
               "torch.load(p, weights_only = False)", "np.load(p, allow_pickle=True)"]  # fmt: skip
    for i, line in enumerate(planted):
        (tmp_path / f"m{i}.py").write_text(f"x = 1\n{line}\n")
    (tmp_path / "fine.py").write_text(
        "torch.load(p, weights_only=True)\npickle.dumps(x)\nclass U(pickle.Unpickler): ...\n"
    )
    hits = offending_lines([tmp_path], base=tmp_path)
    assert hits == [f"m{i}.py:2: {line}" for i, line in enumerate(planted)]
