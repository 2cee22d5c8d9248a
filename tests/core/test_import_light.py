"""The core imports without any heavy backend, and never imports a plugin."""

import subprocess
import sys

#: a hang guard only, for a child process (a Python start-up importing torch, a make run):
#: far above what it takes on a loaded machine, so it never decides a test
HANG_GUARD_S = 600


def test_import_geartrain_pulls_no_backend() -> None:
    code = (
        "import sys, geartrain, geartrain.hookspecs, geartrain.testing, geartrain.cli\n"
        "heavy = [m for m in ('vllm', 'sglang', 'megatron', 'flash_attn', 'ray', 'geartrain_fsdp', 'geartrain_vllm') "
        "if m in sys.modules]\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_core_source_never_imports_a_plugin() -> None:
    from pathlib import Path

    import geartrain

    root = Path(geartrain.__file__).parent
    offenders = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if any(
            f"import geartrain_{x}" in p.read_text() or f"from geartrain_{x}" in p.read_text()
            for x in ("fsdp", "megatron", "vllm", "sglang")
        )
    ]
    assert offenders == []
