"""Issue 35 (round 9's reading): an agent job's environment step that never returns, with
``rollout.agent.step_timeout_s`` unset, ran on a ThreadPoolExecutor, whose threads the
interpreter joins at exit: after Ctrl-C the process stayed until killed. The episode
runner (and the async generation queue) now use :class:`DaemonThreadPool`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import CancelledError
from pathlib import Path

import pytest
from geartrain.daemon_pool import DaemonThreadPool

#: a hang guard only: far above a child's start-up (it imports torch) on a loaded machine
HANG_GUARD_S = 600
TESTS = Path(__file__).resolve().parent


def test_ctrl_c_during_an_environment_step_that_never_returns_exits_the_process() -> None:
    child = textwrap.dedent(
        """
        import os, signal, threading
        # as in a terminal: a suite started in the background (`make test &`) ignores SIGINT,
        # and a child inherits that
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from geartrain import SamplingParams
        from geartrain.agents import Environment, EpisodeRunner, RunnerLimits, StepResult
        from geartrain.testing.tiny import tiny_tokenizer
        from scripted_turns import scripted_generate

        class Hang(Environment):
            def reset(self, task):
                return ""

            def step(self, action):
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the step runs
                threading.Event().wait()  # forever

        tok = tiny_tokenizer()
        runner = EpisodeRunner(scripted_generate(tok, ["1"]), tok, Hang, RunnerLimits(max_turns=3, max_model_len=128))
        try:
            runner.run([tok.encode("q=", add_special_tokens=False)], [{"prompt": "q="}], SamplingParams())
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    try:
        out = subprocess.run(
            [sys.executable, "-c", child], capture_output=True, text=True, timeout=HANG_GUARD_S, env=env
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit: the hung step's thread was joined at exit")
    assert out.returncode == 0 and "interrupted" in out.stdout, out.stderr


def test_results_exceptions_and_order() -> None:
    pool = DaemonThreadPool(2, thread_name_prefix="t")
    assert [f.result() for f in [pool.submit(pow, 2, n) for n in range(8)]] == [2**n for n in range(8)]
    with pytest.raises(SystemExit):  # a BaseException reaches the waiter, not the thread's top
        pool.submit(sys.exit, 3).result()
    names = {pool.submit(lambda: threading.current_thread().name).result() for _ in range(4)}
    assert names <= {"t_0", "t_1"} and all(t.daemon for t in threading.enumerate() if t.name in names)
    pool.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(pow, 2, 2)


def test_shutdown_cancels_what_has_not_started_and_waits_for_what_runs() -> None:
    release, started = threading.Event(), threading.Event()

    def slow() -> str:
        started.set()
        release.wait()
        return "done"

    pool = DaemonThreadPool(1)
    running, queued = pool.submit(slow), pool.submit(pow, 2, 2)
    started.wait()
    closer = threading.Thread(target=pool.shutdown, kwargs={"cancel_futures": True})
    closer.start()
    with pytest.raises(CancelledError):
        queued.result()
    assert closer.is_alive()  # still waiting for the call in progress
    release.set()
    closer.join()
    assert running.result() == "done"
