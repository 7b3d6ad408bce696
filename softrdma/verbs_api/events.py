"""A queue of pending events with a file descriptor, as libibverbs gives for completion
channels and async events: the fd is readable exactly while events are pending, so it
works with select, poll, epoll and asyncio.

The fd is a non-blocking pipe used as a level flag: a byte per event put, drained when the
queue empties (so each event is also an edge, for epoll's EPOLLET). Neither end ever blocks, so a program that never reads its
events can never stall the stack that produces them.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import deque
from typing import Any

from ..readiness import readable

__all__ = ["EventQueue"]


class EventQueue:
    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._items: deque[Any] = deque()
        self._lock = threading.Lock()
        self.closed = False

    @property
    def fd(self) -> int:
        return self._r

    def __len__(self) -> int:
        return len(self._items)

    def _raise_flag(self) -> None:
        try:
            os.write(self._w, b"e")
        except OSError:  # full: the flag is up anyway
            pass

    def put(self, item: Any) -> None:
        with self._lock:
            if self.closed:
                return
            self._items.append(item)
            # a byte per event: each event is an edge for an EPOLLET waiter, as each event
            # wakes the waiters of a uverbs or rdma_cm event file (get() drains them all
            # when the queue empties; a full pipe is a raised flag all the same)
            self._raise_flag()

    def get(self) -> Any | None:
        """The oldest event, or None if there is none (never blocks)."""
        with self._lock:
            if not self._items:
                return None
            item = self._items.popleft()
            if not self._items:
                try:
                    while os.read(self._r, 4096):
                        pass
                except OSError:  # drained (EAGAIN)
                    pass
            return item

    def take_where(self, pred: Any) -> list[Any]:
        """Remove and return, oldest first, the queued items ``pred`` accepts (the others
        stay in order); the fd stays readable exactly while items remain."""
        with self._lock:
            taken = [it for it in self._items if pred(it)]
            if taken:
                self._items = deque(it for it in self._items if not pred(it))
                if not self._items:
                    try:
                        while os.read(self._r, 4096):
                            pass
                    except OSError:  # drained (EAGAIN)
                        pass
            return taken

    def wake(self) -> None:
        """Make the fd readable with no event: a waiter wakes and looks at the world again
        (the device failed)."""
        with self._lock:
            if not self.closed:
                self._raise_flag()

    def wait(self, deadline: float | None) -> None:
        """Block until the fd is readable or ``deadline`` (time.monotonic) passes."""
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        readable([self._r], left)

    async def wait_async(self) -> None:
        """Until the fd is readable (an event is pending, or :meth:`wake`), through the
        running asyncio loop's reader."""
        if self._items:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        loop.add_reader(self._r, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            loop.remove_reader(self._r)

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            os.close(self._r)
            os.close(self._w)
