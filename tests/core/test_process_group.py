"""The one-rank process group a role of a local job runs in."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    from geartrain.cluster.process_group import acquire_single_rank_group, release_single_rank_group

    for _ in range(3):  # the SFT warm start's roles, then the RL loop's: a new default group each time
        release_single_rank_group(acquire_single_rank_group("cpu"))
    group = acquire_single_rank_group("cpu")
    raise RuntimeError("boom")
    """
)


def test_an_uncaught_traceback_is_prefixed_once_however_often_the_group_was_made() -> None:
    """Probes7 (issue 35, case 35): a hook raising mid-training printed every traceback line
    as "[rank0]: [rank0]: ": torch wraps ``sys.excepthook`` at every ``init_process_group``,
    and a local job makes the default group again for each phase."""
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stderr.splitlines() if line]
    assert done.returncode == 1
    assert lines[-1] == "[rank0]: RuntimeError: boom", done.stderr[-2000:]
    assert all(line.startswith("[rank0]: ") and not line.startswith("[rank0]: [rank0]") for line in lines)
