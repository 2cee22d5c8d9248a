"""Run the main job (``geartrain train examples/arithmetic/grpo.toml``) for seeds 0-4 and
record held-out accuracy before/after GRPO and the wall time of each whole run (start-up
included) in bench/RESULTS.md, section "Main job: seeds".

    .venv/bin/python bench/main_job_seeds.py            # all five seeds, about 15 minutes
    .venv/bin/python bench/main_job_seeds.py 0 3        # some seeds

Too slow for CI; tests/e2e/test_main_job.py runs the default seed.
"""

from __future__ import annotations

import platform
import re
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "arithmetic" / "grpo.toml"
RESULTS = ROOT / "bench" / "RESULTS.md"
SECTION = "## Main job: seeds"


def run_seed(seed: int, out_root: Path) -> dict[str, float | int | str]:
    out = out_root / f"seed{seed}"
    cmd = [
        sys.executable,
        "-m",
        "geartrain.cli",
        "train",
        str(CONFIG),
        f"trainer.seed={seed}",
        f"model.seed={seed}",
        f"sft.seed={seed}",
        f"data.seed={seed}",
        f"trainer.output_dir={out}",
        "trainer.progress=false",
        "--overwrite",
    ]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        return {
            "seed": seed,
            "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed",
            "seconds": seconds,
        }
    before = float(re.search(r"accuracy before GRPO: ([\d.]+)%", proc.stdout).group(1))
    after = float(re.search(r"accuracy after GRPO: ([\d.]+)%", proc.stdout).group(1))
    return {"seed": seed, "before": before, "after": after, "gain": after - before, "seconds": seconds}


def table(rows: list[dict]) -> str:
    lines = [
        "| seed | before GRPO | after GRPO | gain (points) | wall time (s) | >= 30 points |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['seed']} | error: {r['error']} | | | {r['seconds']:.0f} | no |")
        else:
            ok = "yes" if r["gain"] >= 30 and r["seconds"] < 300 else "no"
            lines.append(
                f"| {r['seed']} | {r['before']:.1f}% | {r['after']:.1f}% | {r['gain']:+.1f} "
                f"| {r['seconds']:.0f} | {ok} |"
            )
    return "\n".join(lines)


def write_section(body: str) -> None:
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    start = text.find(SECTION)
    if start >= 0:
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + body + (text[end:] if end >= 0 else "\n")
    else:
        text = text.rstrip("\n") + "\n\n" + body + "\n"
    RESULTS.write_text(text)


def main(argv: list[str]) -> None:
    seeds = [int(s) for s in argv] or [0, 1, 2, 3, 4]
    out_root = ROOT / "outputs" / "bench_seeds"
    rows = []
    for seed in seeds:
        rows.append(run_seed(seed, out_root))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    body = (
        f"{SECTION}\n\n`python bench/main_job_seeds.py` ({when}, {platform.machine()}, "
        "2 CPU cores shared with other jobs; wall time = the whole `geartrain train` process, start-up included). "
        "Held-out accuracy: greedy exact match on the 256 validation problems never seen in training. "
        "A seed sets `trainer.seed`, `model.seed` (initial weights), `sft.seed` and `data.seed` (data order).\n\n"
        + table(rows)
        + "\n"
    )
    write_section(body)
    print(body)


if __name__ == "__main__":
    main(sys.argv[1:])
