"""Waiting for descriptors to become readable, with no limit on their numbers.

``select.select`` refuses any descriptor of 1024 (``FD_SETSIZE``) or more with
``ValueError: filedescriptor out of range``, and a softrdma process reaches such numbers
in ordinary use: a device keeps up to 4,096 UDP sockets for its QPs' source ports (and
raises ``RLIMIT_NOFILE`` to allow it), an application holds its own. Every wait of the
library therefore goes through :func:`readable`, which uses ``poll(2)``.

And how long a waiter polls before it sleeps there: :func:`busy_poll_window`, a multiple
of the turnarounds it measured (:class:`BusyPoll`), so a fast peer's answer is seen
without a sleep and a wake-up, and a slow peer's does not cost a spinning CPU.
"""

from __future__ import annotations

import os
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


# -- how long to poll before sleeping -----------------------------------------------------------

#: SOFTRDMA_BUSY_POLL=0: the fixed window of before (:data:`SPIN_MAX` whatever the peer does)
BUSY_POLL = os.environ.get("SOFTRDMA_BUSY_POLL", "1") != "0"
#: the most a waiter polls before it sleeps (the fixed window of before): past it, a
#: stalled peer costs no CPU
SPIN_MAX = 0.002
#: the least: a sleep in poll(2) and its wake-up cost about 22 us each on the 2-core VM
#: this was measured on (the bare Python UDP ping-pong runs at 17 us a round trip when both
#: processes stay on-CPU, 61 us when each sleeps in recv: (61 - 17) / 2); polling for less
#: than two of those saves nothing a sleep would cost
SPIN_MIN = 50e-6
#: poll for this many times the 90th percentile of the recent waits: nine answers in ten
#: come within the percentile, and the factor covers the scatter of the tenth without a
#: sleep (a sleep and a wake-up cost more than the spin on this VM, see SPIN_MIN)
SPIN_FACTOR = 2.0
#: the share of recent waits the window must cover (before the factor)
SPIN_PERCENTILE = 0.9
#: how many recent waits the window is derived from
SPIN_HISTORY = 16


def busy_poll_window(waits: Sequence[float], factor: float = SPIN_FACTOR,
                     floor: float = SPIN_MIN, ceiling: float = SPIN_MAX) -> float:
    """How long (seconds) to poll for an answer before sleeping, given the durations of the
    recent waits that had to wait at all: ``factor`` times their 90th percentile, at
    least ``floor``, at most ``ceiling``. A peer whose *typical* (median) answer comes
    later than ``ceiling`` is a slow peer: spinning for it would burn a CPU the peer may
    need, so the window is ``floor`` (the wake-up is cheap next to the wait). No history
    yet: ``ceiling``, the fixed window of before, until there is."""
    if not waits:
        return ceiling
    s = sorted(waits)  # the order statistics, without statistics' cost on a hot path
    n = len(s)
    k = n // 2
    typical = s[k] if n % 2 else (s[k - 1] + s[k]) / 2
    if typical > ceiling:
        return floor
    high = s[min(n - 1, int(SPIN_PERCENTILE * n))]
    return min(ceiling, max(floor, factor * high))


class BusyPoll:
    """The busy-poll window of one waiter (a CQ a loop waits on), derived from the
    turnarounds it measured: :meth:`record` each wait that was not answered at once (how
    long it took, sleeps included), and ask :meth:`window` when the next wait starts
    polling. With ``SOFTRDMA_BUSY_POLL=0`` (or ``adaptive=False``) the window stays
    :data:`SPIN_MAX`.

    Nothing of this is on the answer's path: a waiter that got its answer only notes how
    long it took (:attr:`last`); the next wait files it (:meth:`settle`) once its first
    poll came back empty, and asks for the window only when it has polled for
    :data:`SPIN_MIN` (no window is shorter)."""

    __slots__ = ("_window", "_waits", "_next", "_history", "_adaptive", "_stale", "last")

    def __init__(self, adaptive: bool | None = None, history: int = SPIN_HISTORY) -> None:
        self._adaptive = BUSY_POLL if adaptive is None else adaptive
        self._history = max(1, history)
        self._waits: list[float] = []
        self._next = 0  # the oldest of a full history: replaced next
        self._window = SPIN_MAX
        self._stale = False
        self.last: float | None = None  #: the latest wait, not yet filed (settle)

    def settle(self) -> None:
        """File :attr:`last` (if a wait left one) in the history."""
        if self.last is not None:
            self.record(self.last)
            self.last = None

    def record(self, waited: float) -> None:
        """A wait took ``waited`` seconds (from its first empty poll to its answer)."""
        if not self._adaptive:
            return
        w = self._waits
        if len(w) < self._history:
            w.append(waited)
        else:
            w[self._next] = waited
            self._next = (self._next + 1) % self._history
        self._stale = True

    def window(self) -> float:
        """Seconds to poll before sleeping, for the wait that starts now."""
        self.settle()
        if self._stale:
            self._window = busy_poll_window(self._waits)
            self._stale = False
        return self._window

    @property
    def waits(self) -> list[float]:
        """The recorded waits (seconds) the window is derived from, oldest first (and
        :attr:`last`, not yet filed)."""
        w = self._waits
        return w[self._next:] + w[:self._next] + ([] if self.last is None else [self.last])
