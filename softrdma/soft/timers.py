"""A device's timers: when each QP (or other timer owner) next wants waking, in one heap.

rxe gives every QP two kernel timers (``retrans_timer``, ``rnr_nak_timer``) and lets the
kernel's timer wheel find the due ones. softrdma has no timer wheel, so the device keeps
one :class:`DeviceTimers`: an *owner* is anything with ``deadline`` (a time or None),
``closed`` and ``on_timer(now)`` (a QP engine, the CM service, a fault delay line). The
owner keeps its own deadlines and says when they changed (:meth:`DeviceTimers.changed`);
the driver asks for the earliest (:meth:`DeviceTimers.next_deadline`) and fires the due
ones (:meth:`DeviceTimers.fire`).

Costs do not grow with the number of QPs: arming, cancelling and moving a timer are
O(log n) or O(1), the next deadline is the heap's top, and an owner with no timer armed
is not in the structure at all (idle QPs cost nothing).

The heap holds ``[deadline, seq, owner]`` entries, at most one live entry per owner,
indexed by owner. Maintenance is lazy: a timer moved *later* (the retransmit timer pushed
out by every ACK, rxe's ``mod_timer``) keeps its early entry; when that entry reaches the
top it is checked against the owner's real deadline and re-filed. A timer moved *earlier*
gets a fresh entry (the old one becomes stale). A cancelled timer's entry goes stale at
once; stale entries are dropped when they reach the top, or all together when they
outnumber the live ones (so a destroyed QP is not kept alive by a far-off timer).

Not thread-safe by itself: the device calls it with its lock held, or from the one thread
driving a manual device.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable, KeysView

__all__ = ["DeviceTimers"]

_COMPACT_AFTER = 64  # stale entries tolerated before they may outnumber the live ones


class DeviceTimers:
    """The armed timers of one device's owners, earliest first."""

    def __init__(self) -> None:
        self._heap: list[list[Any]] = []
        self._entry: dict[Any, list[Any]] = {}  # owner -> its live heap entry
        self._seq = 0  # ties broken by filing order (owners need not be comparable)
        self._stale = 0  # heap entries no longer live
        # told the new deadline whenever an owner arms or moves a timer (the progress
        # thread wakes early if it is sleeping past it)
        self.on_change: Callable[[float], None] | None = None

    @property
    def owners(self) -> KeysView[Any]:
        """The owners with a timer armed (a read-only view)."""
        return self._entry.keys()

    @property
    def heap_size(self) -> int:
        """Heap entries, live and stale (what compaction keeps bounded)."""
        return len(self._heap)

    def changed(self, owner: Any) -> None:
        """``owner``'s deadline changed (armed, moved, cancelled): refile it."""
        d = owner.deadline
        entries = self._entry
        e = entries.get(owner)
        if d is None or owner.closed:
            if e is not None:
                del entries[owner]
                self._stale_one()
            return
        if e is None or d < e[0]:
            if e is not None:
                self._stale_one()
            self._seq += 1
            e = [d, self._seq, owner]
            entries[owner] = e
            heapq.heappush(self._heap, e)
        if self.on_change is not None:
            self.on_change(d)

    def next_deadline(self) -> float | None:
        """The earliest armed timer's deadline, or None (tidies the heap on the way)."""
        e = self._top(None)
        return None if e is None else e[0]

    def fire(self, now: float) -> int:
        """Fire every timer due at ``now`` (each owner's ``on_timer(now)`` once, earliest
        first); return how many owners were due. An owner re-armed by its ``on_timer`` (or
        still holding a later timer) is refiled and fires at a later call."""
        due = []
        live = self._entry
        h = self._heap
        while True:
            e = self._top(now)
            if e is None:
                break
            heapq.heappop(h)
            del live[e[2]]
            due.append(e[2])
        for owner in due:
            if not owner.closed:
                owner.on_timer(now)
            if owner not in live and owner.deadline is not None and not owner.closed:
                self.changed(owner)  # a timer that was not due, still armed
        return len(due)

    def _stale_one(self) -> None:
        """One more heap entry went stale; compact once they outnumber the live ones."""
        self._stale += 1
        if self._stale > _COMPACT_AFTER and self._stale > len(self._entry):
            live = self._entry
            h = [e for e in self._heap if live.get(e[2]) is e]
            heapq.heapify(h)
            self._heap = h
            self._stale = 0

    def _top(self, now: float | None) -> list[Any] | None:
        """The heap's first live, exact entry (stale entries dropped, early ones refiled on
        the way); with ``now``, only if it is due by then. None if there is none."""
        h = self._heap
        live = self._entry
        while h:
            e = h[0]
            if now is not None and e[0] > now:
                return None
            owner = e[2]
            if live.get(owner) is not e:  # stale: cancelled or superseded
                heapq.heappop(h)
                self._stale -= 1
                continue
            d = owner.deadline
            if d is None or owner.closed:  # changed behind our back: drop it
                heapq.heappop(h)
                del live[owner]
                continue
            if d != e[0]:  # moved (later, normally): refile at the real deadline
                self._seq += 1
                e2 = [d, self._seq, owner]
                live[owner] = e2
                heapq.heapreplace(h, e2)
                continue
            return e
        return None
