"""The command in a terminal (issue 19, item 14): --version, the effective config, plugins
within 80 columns, no BrokenPipeError under | head, no reStructuredText in help, and a
--help that imports no torch (lazy imports)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from geartrain import __version__
from geartrain.trainer import load_train_config

#: a hang guard only, for a child process (a Python start-up importing torch, a make run):
#: far above what it takes on a loaded machine, so it never decides a test
HANG_GUARD_S = 600

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "examples" / "arithmetic" / "grpo.toml"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "geartrain.cli", *args], capture_output=True, text=True, timeout=HANG_GUARD_S
    )


def test_version() -> None:
    out = _cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"geartrain {__version__}"


def test_config_prints_the_effective_config_as_toml_that_loads_back(tmp_path: Path) -> None:
    out = _cli("config", str(JOB), "trainer.total_steps=7")
    assert out.returncode == 0, out.stderr
    data = tomllib.loads(out.stdout)
    assert data["trainer"]["total_steps"] == 7 and data["reward"]["function"] == "task.py:exact_match"
    again = tmp_path / "effective.toml"
    again.write_text(out.stdout)
    original = load_train_config(JOB, ["trainer.total_steps=7"], check_plugins=False).model_dump(exclude={"base_dir"})
    assert load_train_config(again, check_plugins=False).model_dump(exclude={"base_dir"}) == original
    defaults = _cli("config")
    assert defaults.returncode == 0 and "[sampling]\nn = 8\n" in defaults.stdout


def test_plugins_fit_80_columns() -> None:
    out = _cli("plugins")
    assert out.returncode == 0 and "torch (rollout) from geartrain" in out.stdout
    assert max(len(line) for line in out.stdout.splitlines()) <= 80


def test_a_closed_pipe_is_not_a_traceback() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "geartrain.cli", "config", "--schema"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    proc.stdout.close()  # the reader is gone before the first line (what `| head` does after its lines)
    _, err = proc.communicate(timeout=HANG_GUARD_S)
    assert "BrokenPipeError" not in err and "Traceback" not in err, err
    assert proc.returncode == 141


def test_help_has_no_restructuredtext_and_imports_no_torch() -> None:
    for args in (["--help"], *([c, "--help"] for c in ("plugins", "check", "config", "train"))):
        out = _cli(*args)
        assert out.returncode == 0, out.stderr
        assert "``" not in out.stdout and ":func:" not in out.stdout and ":mod:" not in out.stdout, out.stdout
    schema = _cli("config", "--schema").stdout
    assert "``" not in schema and ":func:" not in schema
    code = (
        "import sys\nfrom geartrain.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'transformers', 'tensordict', 'pydantic') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
