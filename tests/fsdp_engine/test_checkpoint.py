"""DCP checkpoints: resuming in a fresh process group continues bitwise like an
uninterrupted run, and a save killed with SIGKILL leaves the previous checkpoint the
newest loadable one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from geartrain.checkpoint import CheckpointManager

from .common import run_ranks
from .workers import resume_run


def test_hook_load_checkpoint_resume_is_bitwise_identical(tmp_path: Path) -> None:
    first = run_ranks(resume_run, 2, str(tmp_path), "straight")
    resumed = run_ranks(resume_run, 2, str(tmp_path), "resume")
    for rank in range(2):
        straight_losses, straight_params = first[rank]["straight"]
        assert first[rank]["first_half"] == straight_losses[:2]
        assert resumed[rank]["extra"] == {"step": 2, "note": "two"}
        assert resumed[rank]["losses"] == straight_losses[2:]  # bitwise: exact float equality
        for name, p in straight_params.items():
            assert torch.equal(resumed[rank]["params"][name], p), name


KILLED_SAVE = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from geartrain.checkpoint import CheckpointManager
    from fsdp_engine.common import make_batch, make_engine, token_mean_loss

    class SlowPickle:
        # pickled while trainer.pt is written, i.e. in the middle of the checkpoint write
        def __reduce__(self):
            print("SAVING", flush=True)
            time.sleep(3600)  # until the test kills it: no clock decides when
            return (dict, ())

    engine = make_engine("qwen2")
    manager = CheckpointManager({root!r})
    engine.forward_backward(make_batch(0), token_mean_loss)
    engine.optimizer_step()
    engine.save_checkpoint(manager, 1, {{"step": 1}})
    engine.forward_backward(make_batch(1), token_mean_loss)
    engine.optimizer_step()
    engine.save_checkpoint(manager, 2, {{"step": 2, "slow": SlowPickle()}})
    """
)


def test_hook_save_checkpoint_killed_midway_leaves_previous_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    tests_dir = str(Path(__file__).resolve().parents[1])
    script = KILLED_SAVE.format(tests=tests_dir, root=str(root))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        line = ""
        while "SAVING" not in line:  # an order of events: the second save's pickling, or the child's end
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()
        partial = root / ".partial-step_00000002"
        assert (partial / "dcp").exists()  # the model/optimizer shards were already being written
    finally:
        proc.kill()  # SIGKILL, midway through the second save
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    manager = CheckpointManager(root)
    latest = manager.latest()
    assert latest is not None and latest.name == "step_00000001"

    from .common import full_params, make_batch, make_engine, token_mean_loss

    engine = make_engine("qwen2")
    assert engine.load_checkpoint(latest) == {"step": 1}
    reference = make_engine("qwen2")
    reference.forward_backward(make_batch(0), token_mean_loss)
    reference.optimizer_step()
    got, want = full_params(engine), full_params(reference)
    assert all(torch.equal(got[k], want[k]) for k in want)
