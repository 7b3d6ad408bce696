"""Waiting for descriptors to become readable, with no limit on their numbers.

``select.select`` refuses any descriptor of 1024 (``FD_SETSIZE``) or more with
``ValueError: filedescriptor out of range``, and a softrdma process reaches such numbers
in ordinary use: a device keeps up to 4,096 UDP sockets for its QPs' source ports (and
raises ``RLIMIT_NOFILE`` to allow it), an application holds its own. Every wait of the
library therefore goes through :func:`readable`, which uses ``poll(2)``.
"""

from __future__ import annotations

import select
from typing import Protocol, Sequence, TypeVar, Union


class HasFileno(Protocol):
    def fileno(self) -> int: ...


W = TypeVar("W", bound=Union[int, HasFileno])

# what select() reports as readable: data, the peer gone, or an error to collect
_READY = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR


def _fd(w: int | HasFileno) -> int:
    return w if isinstance(w, int) else w.fileno()


def readable(waitables: Sequence[W], timeout: float | None) -> list[W]:
    """Those of ``waitables`` (descriptors, or objects with ``fileno()``) that are
    readable, waiting at most ``timeout`` seconds (None: until one is; 0: not at all).
    ``select.select(waitables, [], [], timeout)[0]``, for any descriptor number."""
    poller = select.poll()
    for w in waitables:
        poller.register(_fd(w), _READY)
    ms = None if timeout is None else max(0, int(timeout * 1000 + 0.999))  # round up
    ready = {fd for fd, _ in poller.poll(ms)}
    return [w for w in waitables if _fd(w) in ready]
