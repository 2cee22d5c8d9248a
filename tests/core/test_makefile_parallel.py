"""`make test` side by side (two suites by default; ``make -jN test``, ``make test
TEST_JOBS=N``): lint runs alone first and a failing lint starts nothing else; every
environment is complete before any suite starts (and is built once); the SGLang suites keep
their order; ``make test TEST_JOBS=1`` (or ``make -j1 test``) runs the suites one after
another in the order plain ``make test`` did before it ran two at once.

Run for real on a copy of the repository's Makefile in a temporary directory whose tools are
stand-ins: ``ruff``, ``python`` (for ``-m venv``) and each environment's ``pip`` and
``python`` are scripts that log what they were asked, and when, and sleep a little."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

#: a hang guard only, for a child process (a Python start-up importing torch, a make run):
#: far above what it takes on a loaded machine, so it never decides a test
HANG_GUARD_S = 600

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [
    "core/pyproject.toml",
    "plugins/fsdp_engine/pyproject.toml",
    "plugins/vllm_rollout/pyproject.toml",
    "plugins/megatron_engine/pyproject.toml",
    "plugins/sglang_rollout/pyproject.toml",
    "plugins/sglang_rollout/requirements-cpu.txt",
]
#: environment stamp -> its directory, in the order they depend on each other
STAMPS = {
    ".venvs/lint/.ok": ".venvs/lint",
    ".venvs/core/.ok": ".venvs/core",
    ".venvs/fsdp/.ok": ".venvs/fsdp",
    ".venvs/vllm/.ok": ".venvs/vllm",
    ".venvs/megatron/.ok": ".venvs/megatron",
    ".venvs/sglang/.ok": ".venvs/sglang",
    ".venvs/sglang/.e2e": ".venvs/sglang",
    ".venv/.base": ".venv",
    ".venv/.full": ".venv",
}
SEQUENTIAL = ["core", "fsdp_engine", "vllm_rollout", "megatron_engine", "sglang_rollout", "sglang-e2e", "e2e", "ray"]

# An environment's python: an environment build's `python -c CHECK` logs "check ENV t"; a
# suite logs "start SUITE t" / "end SUITE t" (SUITE: the tests/ folder it was given; the SGLang
# e2e suite names files of tests/e2e).
SUITE_PY = r"""#!/bin/sh
if [ "$1" = "-c" ]; then echo "check $(dirname "$(dirname "$0")") $(date +%s.%N)" >> "$GT_LOG"; exit 0; fi
case "$*" in
  *test_main_job_sglang.py*) suite=sglang-e2e ;;
  *) suite=$(echo "$*" | grep -o 'tests/[a-z0-9_]*' | head -1 | cut -d/ -f2) ;;
esac
echo "start $suite $(date +%s.%N)" >> "$GT_LOG"
sleep "$GT_SUITE_S"
echo "end $suite $(date +%s.%N)" >> "$GT_LOG"
"""
PIP = r"""#!/bin/sh
echo "pip $(dirname "$(dirname "$0")") $(date +%s.%N)" >> "$GT_LOG"
"""
RUFF = r"""#!/bin/sh
echo "ruff-start $1 $(date +%s.%N)" >> "$GT_LOG"
sleep "$GT_LINT_S"
echo "ruff-end $1 $(date +%s.%N)" >> "$GT_LOG"
exit "$GT_LINT_RC"
"""
# $(PYTHON): only `python -m venv DIR` is asked of it; it lays out DIR with the stand-ins.
VENV_PY = r"""#!/bin/sh
[ "$1 $2" = "-m venv" ] || { echo "unexpected: python $*" >&2; exit 1; }
echo "venv-start $3 $(date +%s.%N)" >> "$GT_LOG"
sleep "$GT_VENV_S"
mkdir -p "$3/bin"
cp "$GT_BIN/suite_python" "$3/bin/python"
cp "$GT_BIN/pip" "$3/bin/pip"
cp "$GT_BIN/ruff" "$3/bin/ruff"
echo "venv-end $3 $(date +%s.%N)" >> "$GT_LOG"
"""


@dataclass
class Event:
    what: str
    name: str
    at: float


def _script(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """The Makefile and the files its environments depend on, every environment built
    (stand-ins, stamps newer than what they depend on)."""
    if shutil.which("make") is None:
        pytest.fail("this test needs make")
    work = tmp_path / "repo"
    bin_dir = tmp_path / "bin"
    for name, text in (("suite_python", SUITE_PY), ("pip", PIP), ("ruff", RUFF), ("python", VENV_PY)):
        _script(bin_dir / name, text)
    work.mkdir()
    shutil.copy(ROOT / "Makefile", work / "Makefile")
    old = time.time() - 3600
    for source in ["Makefile", *SOURCES]:
        (work / source).parent.mkdir(parents=True, exist_ok=True)
        (work / source).touch()
        os.utime(work / source, (old, old))
    for i, (stamp, venv) in enumerate(STAMPS.items()):
        (work / venv / "bin").mkdir(parents=True, exist_ok=True)
        for tool in ("python", "pip", "ruff"):
            shutil.copy(bin_dir / ("suite_python" if tool == "python" else tool), work / venv / "bin" / tool)
        (work / stamp).touch()
        os.utime(work / stamp, (old + 10 * (i + 1),) * 2)
    return work


def make(repo: Path, *args: str, lint_rc: int = 0, lint_s: float = 0.0) -> tuple[subprocess.CompletedProcess, list]:
    log = repo.parent / "events.log"
    log.write_text("")
    env = dict(
        os.environ,
        GT_LOG=str(log),
        GT_BIN=str(repo.parent / "bin"),
        GT_SUITE_S="0.1",
        GT_VENV_S="0.1",
        GT_LINT_S=str(lint_s),
        GT_LINT_RC=str(lint_rc),
    )
    env.pop("MAKEFLAGS", None)
    env.pop("MFLAGS", None)
    proc = subprocess.run(
        ["make", "--no-print-directory", *args, f"PYTHON={repo.parent / 'bin' / 'python'}"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    events = [Event(w, n, float(t)) for w, n, t in (line.split() for line in log.read_text().splitlines())]
    return proc, events


def suites(events: list[Event]) -> dict[str, tuple[float, float]]:
    """suite -> (start, end); each suite must have run exactly once."""
    starts = [e.name for e in events if e.what == "start"]
    assert len(starts) == len(set(starts)), starts
    return {
        e.name: (e.at, next(x.at for x in events if x.what == "end" and x.name == e.name))
        for e in events
        if e.what == "start"
    }


def most_at_once(spans: dict[str, tuple[float, float]]) -> int:
    return max(sum(1 for s, e in spans.values() if s <= t < e) for t, _ in spans.values())


@pytest.mark.parametrize("args", [["-j8", "test"], ["test", "TEST_JOBS=8"]])
def test_a_failing_lint_starts_nothing_else(repo: Path, args: list[str]) -> None:
    proc, events = make(repo, *args, lint_rc=1, lint_s=1.0)
    assert proc.returncode != 0
    assert [e.what for e in events] == ["ruff-start", "ruff-end"], events  # no suite, no environment, no pip


@pytest.mark.parametrize(
    "args", [["test"], ["-j2", "test"], ["test", "TEST_JOBS=2"], ["-j3", "test", "TEST_JOBS=3"], ["-j3", "test"]]
)
def test_side_by_side_suites_start_after_lint_and_after_every_environment(repo: Path, args: list[str]) -> None:
    (repo / "core/pyproject.toml").touch()  # the core, FSDP, vLLM, Megatron, SGLang and .venv rebuild
    proc, events = make(repo, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    spans = suites(events)
    assert sorted(spans) == sorted(SEQUENTIAL)
    first_suite = min(s for s, _ in spans.values())
    lint_end = max(e.at for e in events if e.what == "ruff-end")
    builds = [e for e in events if e.what in ("venv-start", "venv-end", "pip", "check")]
    assert builds and lint_end <= min(e.at for e in builds)
    # .venvs/sglang/.e2e (pip into the SGLang env) belongs between the two SGLang suites
    e2e = [e for e in builds if e.at > first_suite]
    assert e2e and all(e.what == "pip" and e.name.endswith(".venvs/sglang") for e in e2e), e2e
    assert spans["sglang_rollout"][1] <= min(e.at for e in e2e) and max(e.at for e in e2e) <= spans["sglang-e2e"][0]
    assert max(e.at for e in builds if e not in e2e) <= first_suite, "a suite started while an environment was built"
    built = [e.name for e in events if e.what == "venv-start"]
    assert sorted(built) == sorted(set(built)), f"an environment was built twice at once: {built}"
    given = [a for a in args if a.startswith(("-j", "TEST_JOBS="))]
    jobs = int(given[-1].split("=")[-1].removeprefix("-j")) if given else 2  # two by default
    assert most_at_once(spans) == jobs, spans  # side by side, never more than asked
    assert spans["sglang_rollout"][1] <= spans["sglang-e2e"][0]  # the plugin suite before fsdp joins its env


@pytest.mark.parametrize("args", [["test"], ["test", "TEST_JOBS=2"], ["-j2", "test"]])
def test_side_by_side_starts_the_longest_suites_first(repo: Path, args: list[str]) -> None:
    _, events = make(repo, *args)
    starts = [e.name for e in events if e.what == "start"]
    assert sorted(starts[:2]) == ["e2e", "ray"], starts  # they start together: either may log first
    # the SGLang e2e suite follows the SGLang suite, not every other suite (then it ran alone)
    assert starts.index("sglang-e2e") < len(starts) - 2, starts


@pytest.mark.parametrize("args", [["test", "TEST_JOBS=1"], ["-j1", "test"]])
def test_one_job_runs_lint_then_the_suites_one_after_another_in_order(repo: Path, args: list[str]) -> None:
    proc, events = make(repo, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [e.what for e in events[:4]] == ["ruff-start", "ruff-end", "ruff-start", "ruff-end"]
    assert [e.name for e in events if e.what == "start"] == SEQUENTIAL
    assert most_at_once(suites(events)) == 1
    assert proc.stdout.rstrip().endswith("all geartrain test suites passed")
