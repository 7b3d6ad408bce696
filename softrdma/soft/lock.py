"""The device lock, and the moment a device's queued packets leave.

Everything that makes a soft device act (a verbs call, a batch of received packets, a
timer) runs under its lock, and the engines only queue what they send. When the outermost
holder lets go, the work of that whole section is known, so the transport sends it then:
the packets of a message go out as one train (UDP GSO, softrdma.wire.trains), and the ACKs
a batch of arrivals provoked go out after the batch, not one by one in the middle of it.
Tying the flush to the lock, not to a list of call sites, means no path can leave a packet
behind.
"""

from __future__ import annotations

import threading
from typing import Callable

__all__ = ["DeviceLock"]


class DeviceLock:
    """A re-entrant lock (an ``RLock``) that calls ``on_release()`` when its outermost
    holder is about to let go, still holding it. ``on_release`` must not raise."""

    __slots__ = ("_lock", "depth", "on_release")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.depth = 0  # nesting of the owner's holds (only the owner reads or writes it)
        self.on_release: Callable[[], None] | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking, timeout):
            self.depth += 1
            return True
        return False

    def release(self) -> None:
        if self.depth == 1 and self.on_release is not None:
            try:
                self.on_release()
            finally:
                self.depth = 0
                self._lock.release()
            return
        self.depth -= 1
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
