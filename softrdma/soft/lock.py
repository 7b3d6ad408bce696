"""The device lock, and the moment a device's queued packets leave.

Everything that makes a soft device act (a verbs call, a batch of received packets, a
timer) runs under its lock, and the engines only queue what they send. When the outermost
holder lets go, the work of that whole section is known, so the transport sends it then:
the packets of a message go out as one train (UDP GSO, softrdma.wire.trains), and the ACKs
a batch of arrivals provoked go out after the batch, not one by one in the middle of it.
Tying the flush to the lock, not to a list of call sites, means no path can leave a packet
behind.

Doorbell batching (``SOFTRDMA_DOORBELL``, on unless set to 0). A NIC does not put a packet
on the wire the instant ``ibv_post_send`` rings its doorbell: it fetches the WQEs when it
gets to them, and the WQEs posted meanwhile go together. rxe does the same with its
requester task (run inline for a lone WQE, scheduled when more are queued). So a
``post_send`` may let go of the lock without the flush (:meth:`DeviceLock.ring`):
its packets stay queued and leave with the next flush the device does anyway, which is
soon, because someone is bound to take the lock:

* with a progress thread (a live device), :attr:`DeviceLock.on_defer` wakes it at once
  when a hold first leaves packets behind; its next pass takes the lock and so flushes
  them, whatever the program does next (polls, blocks in ``get_cq_event``, sleeps);
* without one (manual mode), only a program whose last call into the device was a CQ poll
  defers (:attr:`DeviceLock.polling`): a polling program polls again, and that poll
  flushes. A manual program that posts without polling is flushed at once, as before.

Any other hold of the lock flushes on release, as always: a later verbs call (destroy_qp,
modify_qp to ERR, closing), a received packet, a timer. So deferring moves the moment the
packets leave, never whether they leave; ``SOFTRDMA_DOORBELL=0`` flushes every post.

Coalesced ACKs (``SOFTRDMA_ACK_COALESCE``, on unless 0). A train of requests that each ask
for an ACK needs only one: IBTA lets a responder coalesce ACKs, an ACK acknowledging every
PSN before its own (the requester's completer takes a later PSN as the ACK of the earlier
send and write WQEs; rxe's ``check_psn`` does). So the responder owes the ACK (:meth:`DeviceLock.before_flush`) and
sends it, for the last PSN, when the unit of work that received the train ends: the release
of a hold nested once in the outermost (the transport's receive loop holds the lock around
its batch, and ``SoftDevice.receive``/``receive_train`` hold it around one datagram), or
at the latest before the outermost release's flush. The ACK thus leaves with the flush that
follows the datagram, as before, but once per datagram instead of once per packet.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

__all__ = ["DeviceLock", "switch_on"]

log = logging.getLogger("softrdma")


def switch_on(name: str) -> bool:
    """A feature switch (``SOFTRDMA_DOORBELL``, ``SOFTRDMA_ACK_COALESCE``): on unless set to
    0, no, off or false. Read when a device is made."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "no", "off", "false")


class DeviceLock:
    """A re-entrant lock (an ``RLock``) that calls ``on_release()`` when its outermost
    holder is about to let go, still holding it, unless that hold asked to defer it
    (:meth:`ring`). ``on_release`` and ``on_defer`` must not raise."""

    __slots__ = ("_lock", "depth", "on_release", "batching", "coalesce_acks", "polling",
                 "deferred", "_defer", "_post", "on_defer", "flusher", "deferrals", "_owed")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.depth = 0  # nesting of the owner's holds (only the owner reads or writes it)
        self.on_release: Callable[[], None] | None = None
        #: doorbell batching allowed (SOFTRDMA_DOORBELL, read when the device is made)
        self.batching = switch_on("SOFTRDMA_DOORBELL")
        #: responders may owe one ACK per received datagram (SOFTRDMA_ACK_COALESCE)
        self.coalesce_acks = switch_on("SOFTRDMA_ACK_COALESCE")
        self._owed: list[Callable[[], None]] = []  # before_flush work, in order
        #: the program's calls since its last CQ poll were posts (the poll sets it, any
        #: other flushing hold clears it): in manual mode, a poll is coming
        self.polling = False
        #: a hold let go without its flush and nobody has flushed since (with the lock)
        self.deferred = False
        self._defer = False  # the current hold's release skips the flush
        self._post = False  # the current hold is a post's (it keeps ``polling``)
        #: called once when a hold first leaves packets behind (the progress thread's wake)
        self.on_defer: Callable[[], None] | None = None
        self.flusher: int | None = None  # the thread on_defer wakes (it never defers)
        self.deferrals = 0  # releases that skipped the flush (for tests and benchmarks)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking, timeout):
            self.depth += 1
            return True
        return False

    def ring(self, busy: bool) -> bool:
        """The doorbell of a ``post_send`` that queued packets, rung with the lock held.
        ``busy``: the QP already had work queued or in flight, so the packets may wait
        (an idle QP's go at once: a latency-bound program pays nothing). The release of
        this hold then skips the flush if it is the outermost hold and someone is bound
        to flush soon (module docstring); returns whether it will. Never on the thread
        that ``on_defer`` would wake."""
        if self.depth != 1 or self.on_release is None:
            return False
        self._post = True
        if not busy or not self.batching:
            return False
        if self.on_defer is None:
            if not self.polling:
                return False
        elif threading.get_ident() == self.flusher:
            return False
        self._defer = True
        return True

    def before_flush(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (with the lock held) when the current unit of work ends: at the
        release of a hold nested once in the outermost (one received datagram or train),
        or of the outermost hold, before its flush. For work owed to the wire that later
        work of the same unit may merge (a coalesced ACK). ``fn`` must not raise."""
        self._owed.append(fn)

    def _pay(self) -> None:
        owed = self._owed
        while owed:  # what one pays may owe more: in order, until none is left
            self._owed = []
            for fn in owed:
                try:
                    fn()
                except Exception:  # a bug: the lock must still be let go, the rest paid
                    log.exception("softrdma: work owed before a flush failed")
            owed = self._owed

    def release(self) -> None:
        if self._owed and self.depth <= 2:
            self._pay()
        if self.depth == 1 and self.on_release is not None:
            if self._defer:
                self._defer = self._post = False
                self.deferrals += 1
                wake = not self.deferred and self.on_defer is not None
                self.deferred = True
                try:
                    if wake:  # the flusher's next pass, made immediate
                        self.on_defer()  # type: ignore[misc]
                finally:
                    self.depth = 0
                    self._lock.release()
                return
            try:
                if self._post:
                    self._post = False
                else:
                    self.polling = False
                self.deferred = False
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
