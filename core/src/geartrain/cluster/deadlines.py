"""Deadlines of the calls into a role's workers, by phase (``cluster.call_timeout_s``), and
the watchdog that holds a call in the driver's own process (the ``inline`` placement) to its
deadline.

On Ray the driver waits for its ranks and reports the ones that do not answer
(:mod:`geartrain.cluster.ray_placement`). Inline, the call runs on the waiting thread itself,
so a hook that never returns (a deadlock in a plugin, a read that never ends) would hold the
job until Ctrl-C. :class:`CallWatchdog` bounds it: at the deadline it raises
:class:`CallDeadlineExceeded` inside the thread making the call (at its next Python
instruction, as Ctrl-C would), which ends the job as any error does: one line, exit 2, the
checkpoints saved so far intact. A call stuck in native code, which no exception can reach,
gets a grace period as long as the deadline (at most a minute) and then ends the process with
the same line and exit 2, as a killed rank would."""

from __future__ import annotations

import ctypes
import os
import sys
import sysconfig
import threading
from pathlib import Path
from types import FrameType, TracebackType

from geartrain.errors import GeartrainError

#: the default deadline of a call by phase (``cluster.call_timeout_s`` overrides)
CALL_TIMEOUTS = {"build": 600.0, "step": 1800.0, "checkpoint": 900.0}
CHECKPOINT_CALLS = frozenset({"save_checkpoint", "load_checkpoint", "export_hf"})
#: the longest a call stuck in native code gets after its deadline before the process ends
MAX_GRACE_S = 60.0


def call_phase(method: str) -> str:
    """The phase whose deadline a call of ``method`` gets."""
    if method == "build":
        return "build"
    return "checkpoint" if method in CHECKPOINT_CALLS else "step"


def phase_setting(method: str) -> str:
    """The setting whose value is the deadline of a call of ``method``."""
    return f"cluster.call_timeout_s.{call_phase(method)}"


def call_deadlines(cluster: object) -> dict[str, float]:
    """Each phase's deadline: ``cluster.call_timeout_s`` over :data:`CALL_TIMEOUTS`."""
    overrides = dict(getattr(cluster, "call_timeout_s", None) or {})
    return {phase: float(overrides.get(phase, default)) for phase, default in CALL_TIMEOUTS.items()}


class CallDeadlineExceeded(GeartrainError):
    """A call into a role's worker did not return within its phase's deadline.

    The watchdog raises a subclass made for the call (an asynchronous exception is raised
    from its class, without arguments), whose class attribute ``message`` says which call,
    how long, and the setting."""

    message = "a call into a role's worker did not return within its deadline (cluster.call_timeout_s)"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or type(self).message)


def _raise_in_thread(thread_id: int, exc_type: type[BaseException] | None) -> None:
    """Raise ``exc_type`` in thread ``thread_id`` at its next Python instruction; ``None``
    withdraws one not raised yet."""
    exc = ctypes.py_object(exc_type) if exc_type is not None else None  # None: a NULL pointer
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), exc)


def _on_stack(frame: FrameType | None, wanted: FrameType) -> bool:
    while frame is not None:
        if frame is wanted:
            return True
        frame = frame.f_back
    return False


class CallWatchdog:
    """Holds one call, made on the current thread inside ``with CallWatchdog(...)``, to
    ``limit_s`` seconds (see the module's docstring). ``what`` names the call
    (``"actor.generate"``), ``setting`` the deadline's setting. Leaving the block after the
    deadline passed raises :class:`CallDeadlineExceeded` whatever the call did with the
    exception (a hook that caught it and returned still took too long)."""

    def __init__(self, what: str, limit_s: float, setting: str) -> None:
        self.what, self.limit_s, self.setting = what, limit_s, setting
        self.grace_s = min(limit_s, MAX_GRACE_S)
        self.message = (
            f"{what} did not return within the {limit_s:g} s deadline of its phase ({setting}); the job "
            "is stopped (a hook that hangs, or the phase needs longer: raise the setting); the checkpoints "
            "saved so far are intact (--resume continues from the newest)"
        )
        self._exc_type = type(CallDeadlineExceeded.__name__, (CallDeadlineExceeded,), {"message": self.message})
        self._done = threading.Event()
        self._fired = False
        self._lock = threading.Lock()
        self._thread_id = 0
        self._frame: FrameType | None = None
        self._timer: threading.Thread | None = None

    def __enter__(self) -> CallWatchdog:
        self._thread_id = threading.get_ident()
        self._frame = sys._getframe(1)  # the caller's frame: on the thread's stack while the call runs
        self._timer = threading.Thread(target=self._watch, name=f"geartrain-deadline {self.what}", daemon=True)
        self._timer.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with self._lock:  # the watchdog fires before this or not at all
            self._done.set()
            fired = self._fired
            if fired:
                _raise_in_thread(self._thread_id, None)  # one not raised yet must not surface later
        self._frame = None
        if fired and not isinstance(exc, CallDeadlineExceeded):
            raise self._exc_type() from exc

    def _still_in_call(self) -> bool:
        return _on_stack(sys._current_frames().get(self._thread_id), self._frame)  # type: ignore[arg-type]

    def _watch(self) -> None:
        if self._done.wait(self.limit_s):
            return
        with self._lock:
            if self._done.is_set():
                return
            self.message += f"; it was in {self._where()}"
            self._exc_type.message = self.message
            self._fired = True
            _raise_in_thread(self._thread_id, self._exc_type)
        if self._done.wait(self.grace_s) or not self._still_in_call():
            return
        print(
            f"error: {self.message}. It did not stop within {self.grace_s:g} s of the deadline (stuck outside "
            "Python, where no exception reaches it): the process ends now",
            file=sys.stderr,
            flush=True,
        )
        os._exit(2)

    def _where(self) -> str:
        """Where the call's thread is, as ``FILE, line N, in FUNCTION``: its innermost frame
        outside Python's standard library (a plugin's loop rather than the ``threading`` or
        ``socket`` call it spins on)."""
        frame = sys._current_frames().get(self._thread_id)
        if frame is None:
            return "(its thread has ended)"
        shown = frame
        while frame is not None and frame is not self._frame:
            if not _in_stdlib(frame.f_code.co_filename):
                shown = frame
                break
            frame = frame.f_back
        return f"{shown.f_code.co_filename}, line {shown.f_lineno}, in {shown.f_code.co_name}"


def _in_stdlib(filename: str) -> bool:
    parts = Path(filename).parts
    return filename.startswith(_STDLIB) and "site-packages" not in parts and "dist-packages" not in parts


_STDLIB = sysconfig.get_paths()["stdlib"]
