"""A thread pool whose threads never hold up the interpreter's exit.

``concurrent.futures.ThreadPoolExecutor`` joins its threads when the interpreter exits, so
a call that never returns (a hung environment step, a hung rollout plugin) keeps the
process alive after Ctrl-C's closing line until it is killed. :class:`DaemonThreadPool`
is the same interface on daemon threads: what is still running at exit is abandoned.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

_Work = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class DaemonThreadPool(Executor):
    """Runs submitted calls on up to ``max_workers`` daemon threads, in submission order.

    Contract: :meth:`submit` returns a :class:`~concurrent.futures.Future` that gets the
    call's result or what it raised (``BaseException`` included); :meth:`shutdown` with
    ``cancel_futures`` cancels what has not started, with ``wait`` joins the threads
    (which waits for the calls in progress). Threads start on demand, one per submission
    until ``max_workers`` run.
    """

    def __init__(self, max_workers: int, thread_name_prefix: str = "geartrain-pool") -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self._max_workers = max_workers
        self._prefix = thread_name_prefix
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._shut = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot submit to a DaemonThreadPool after shutdown")
            future: Future[Any] = Future()
            self._work.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max_workers:
                thread = threading.Thread(target=self._serve, name=f"{self._prefix}_{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
            return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shut = True
            if cancel_futures:
                while True:
                    try:
                        item = self._work.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            for _ in self._threads:
                self._work.put(None)
        if wait:
            for thread in self._threads:
                thread.join()

    def _serve(self) -> None:
        while (item := self._work.get()) is not None:
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                    future.set_exception(exc)
            self._idle.release()
