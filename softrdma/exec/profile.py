"""``SOFTRDMA_EXEC_PROFILE=FILE``: where a C program's time goes inside softrdma.

Every verb a program calls under ``softrdma exec`` is Python, so Python's own profiler
can say what a call costs: with the variable set (``softrdma exec --profile FILE``), the
library runs :mod:`cProfile` in the program's process from its first call and writes
the statistics to ``FILE`` (``{pid}`` in it becomes the process id, for programs that
fork) when the program exits. Read them with :mod:`pstats`::

    python -m pstats FILE          # then: sort tottime / stats 20 / callers post_send

The callbacks C calls appear under their Python names (``post_send``, ``poll_cq``,
``ibv_reg_mr`` ...), with the number of calls and the time in and below each: the
per-call cost of a verb is ``cumtime / ncalls`` of its row.

cProfile profiles one thread per profiler, so each thread gets one of its own and the
file holds their sum: the thread that made the program's first call (for a
single-threaded program such as perftest, every verb it calls) and every thread Python
starts afterwards (the device's progress thread: received packets, ACKs, completions,
retransmission timers). Other threads of the program calling in are not profiled.
A profiled program runs slower (cProfile costs about a microsecond per Python call):
compare shares of the time, not absolute rates, with an unprofiled run.

A C program never finalizes the interpreter the library started, so Python's
:mod:`atexit` would never run there: the statistics are written from a C ``exit``
handler (``__cxa_atexit``, via :mod:`ctypes`) instead -- a program killed by a signal
or leaving with ``_exit`` writes nothing. In a Python program (its own interpreter,
which it finalizes) :mod:`atexit` does it, and the statistics include the program's own
Python as well.
"""

from __future__ import annotations

import atexit
import cProfile
import ctypes
import os
import pstats
import sys
import threading
from typing import Any

__all__ = ["ENV_PROFILE", "start_from_environment"]

#: the variable naming the statistics file (``softrdma exec --profile`` sets it)
ENV_PROFILE = "SOFTRDMA_EXEC_PROFILE"

_profiles: list[cProfile.Profile] = []
_keep: list[Any] = []  # the C exit handler's ctypes thunk, alive until exit


def _profile_this_thread() -> None:
    p = cProfile.Profile()
    p.enable()
    _profiles.append(p)


def _new_thread(frame: Any, event: str, arg: Any) -> None:
    """threading's profile hook, run at a new thread's first event: replaced by a
    profiler of the thread's own."""
    sys.setprofile(None)
    _profile_this_thread()


def _dump(path: str) -> None:
    try:
        stats = pstats.Stats(_profiles[0])  # the exiting thread's own, or the first
        for p in _profiles[1:]:
            stats.add(p)
        stats.dump_stats(path)
    except Exception as e:  # never an exception into exit()
        print(f"softrdma exec: profile not written to {path}: {e}", file=sys.stderr)


def start_from_environment() -> str | None:
    """Start profiling if :data:`ENV_PROFILE` names a file; returns the file (or None).
    Called once, by :func:`softrdma.exec.shim.install`, on the program's first call."""
    path = os.environ.get(ENV_PROFILE)
    if not path:
        return None
    path = os.path.abspath(path.replace("{pid}", str(os.getpid())))
    _profile_this_thread()
    threading.setprofile(_new_thread)
    if getattr(sys, "orig_argv", None):  # a Python program: it finalizes its interpreter
        atexit.register(_dump, path)
        return path
    # a C program: the library started Python and nothing will finalize it
    handler = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _arg: _dump(path))
    _keep.append(handler)
    libc = ctypes.CDLL(None)
    libc.__cxa_atexit(handler, None, None)
    return path
