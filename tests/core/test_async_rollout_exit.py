"""Issue 35 round 9 (probes9): with ``trainer.async_rollout``, a rollout whose ``generate``
never returns (a hung plugin) kept the process alive after Ctrl-C's closing line: the
generation queue ran on a ThreadPoolExecutor, whose thread the interpreter joins at exit.
The queue's thread is a daemon; ``close()`` still waits for the call in progress."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from concurrent.futures import CancelledError

import pytest
from geartrain.trainer.async_rollout import GenerationQueue

#: a hang guard only: far above a child's start-up (it imports torch) on a loaded machine
HANG_GUARD_S = 600


def test_a_generation_that_never_returns_does_not_hold_the_process_at_exit() -> None:
    child = textwrap.dedent(
        """
        import threading
        from geartrain.trainer.async_rollout import GenerationQueue

        class Hung:
            def generate(self, prompts, sampling):
                threading.Event().wait()  # forever

        queue = GenerationQueue(Hung())
        queue.generate([[1]], None)
        print("leaving", flush=True)
        raise KeyboardInterrupt  # as a Ctrl-C that the job has reported
        """
    )
    try:
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit: the hung generation's thread was joined at exit")
    assert "leaving" in out.stdout and "KeyboardInterrupt" in out.stderr


def test_close_runs_what_is_in_hand_in_order_and_cancels_the_rest() -> None:
    release = threading.Event()
    calls: list[str] = []

    class Slow:
        def generate(self, prompts, sampling):
            calls.append("generate")
            release.wait()
            return "batch"

        def update_weights(self, tensors):
            calls.append("load")

    class Snap:
        tensors: list = []

    q = GenerationQueue(Slow())
    first = q.generate([[1]], None)
    second = q.load(Snap(), 1)  # type: ignore[arg-type]
    closer = threading.Thread(target=q.close)
    while calls != ["generate"]:
        threading.Event().wait(0.01)
    closer.start()
    while not second.cancelled():  # close() took the load that had not started off the queue
        threading.Event().wait(0.01)
    release.set()
    closer.join()
    assert first.result().batch == "batch"
    with pytest.raises(CancelledError):
        second.result()
    assert calls == ["generate"]
