"""The progress engine: what makes a soft device move on its own, like a NIC.

A :class:`Progress` thread waits on the device's socket and a wake-up pipe (``selectors``:
epoll on Linux, so descriptors numbered above 1,024 are fine), delivers arriving packets
to the engines, fires the QPs' timers on time and handles looped-back packets. Verbs calls
run on the caller's thread under the device lock (``post_send`` sends at once, and a
caller polling an empty CQ reads the socket itself); the thread does what nobody asked
for: receive while the program sleeps or blocks, time out, and send what a ``post_send``
left queued (doorbell batching, softrdma.soft.lock: such a post wakes the thread at once,
and its next pass, which takes the device lock, flushes them). ``stop()`` joins it, and
every thread still running at interpreter exit is stopped by an ``atexit`` hook, so a
program that never closes its context still exits at once.

The thread cannot die silently: an unexpected error while handling one event is logged
and counted (``counters.progress_errors``) and the loop goes on; if the loop itself cannot
go on (its selector fails), the device is marked failed (:meth:`SoftDevice.fail`), which
wakes every waiter with an error.

While the application polls a CQ (``poll_cq`` reads the socket on the caller's thread,
``SoftDevice.poll_nowait``), the thread stands back from the socket: for
:data:`POLL_GRACE` after the last poll it waits on timers and wake-ups only, so a
packet the poller is about to read is not taken by the thread, handled there, and handed
back across the GIL (the hand-off on the critical path of a polling program's latency).
While the polls go on, it looks again after twice as long each time (up to
:data:`POLL_GRACE_MAX`), without taking the device lock; a program about to block in
``get_cq_event`` calls ``SoftDevice.blocking()``, which hands rx back to the thread at once.

Manual mode (``SoftDevice.attach_udp(..., thread=False)``) has no thread: the program
calls ``device.poll(timeout)`` to make progress, deterministically.
"""

from __future__ import annotations

import atexit
import logging
import os
import selectors
import threading
import time
import weakref
from typing import Any

__all__ = ["Progress", "poll_once", "stop_all"]

MAX_SLEEP = 0.05  # seconds; bounds the wait when no timer is armed
POLL_GRACE = 0.001  # seconds after an application's last CQ poll the thread leaves rx to it
# While the application keeps polling, the thread looks again after twice as long each time,
# up to this: each look costs the poller a hand-over of the GIL (measured: 4 to 8 us off
# the median round trip of a latency loop when the thread did not look every 1 ms). A
# program about to block says so (SoftDevice.blocking), so only a program that stops
# polling without blocking (a sleep, a computation) waits up to this for the thread.
POLL_GRACE_MAX = 0.008
log = logging.getLogger("softrdma")
_running: "weakref.WeakSet[Progress]" = weakref.WeakSet()


def poll_once(device: Any, transport: Any, timeout: float) -> int:
    """Wait up to ``timeout`` for packets or the next timer, handle them; return events."""
    with device.lock:
        dl = device.next_deadline()
        n = device.run_local()
    now = time.monotonic()
    wait = timeout if dl is None else max(0.0, min(timeout, dl - now))
    if n:
        wait = 0.0
    sel = transport.selector()
    ready = sel.select(wait)
    with device.lock:
        if ready:
            n += transport.receive_ready()
        n += device.fire_timers(time.monotonic())
        n += device.run_local()
    return n


class Progress(threading.Thread):
    def __init__(self, device: Any, transport: Any) -> None:
        super().__init__(name=f"softrdma-progress-{device.name}", daemon=True)
        self.device = device
        self.transport = transport
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(transport.fileno(), selectors.EVENT_READ, "rx")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._wake_sel = selectors.DefaultSelector()  # while an application polls: no rx
        self._wake_sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stopping = False
        self._sleep_until = 0.0
        self._logged: set[type] = set()
        device.timers.on_change = self._on_timer_change
        device.on_schedule = self._on_schedule
        device.on_blocking = self._wake  # a program about to block: rx is ours again
        device.lock.on_defer = self._wake  # a post left packets queued: flush them now

    def start(self) -> None:
        super().start()
        _running.add(self)

    def _on_timer_change(self, deadline: float | None) -> None:
        # a timer armed earlier than our wake-up time: wake the thread to re-plan
        if deadline is not None and deadline < self._sleep_until:
            self._wake()

    def _on_schedule(self) -> None:
        # a responder asked for a pass (SoftDevice.schedule_responder) from another thread
        # (a CQ poller's or a verbs call's): this thread may be asleep for MAX_SLEEP
        if threading.get_ident() != self.ident:
            self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except OSError:  # full (a wake-up is pending anyway) or closed (stopping)
            pass

    def run(self) -> None:
        dev = self.device
        dev.lock.flusher = threading.get_ident()  # never defers what it is woken to flush
        grace = POLL_GRACE
        try:
            while not self._stopping:
                with dev.lock:
                    dl = dev.next_deadline()
                now = time.monotonic()
                wait = MAX_SLEEP if dl is None else max(0.0, min(MAX_SLEEP, dl - now))
                sel = self._sel
                polled = dev.polled_at + grace - now
                standing_back = polled > 0
                if standing_back:  # the application is polling: rx is its job for now
                    sel = self._wake_sel
                    wait = min(wait, polled)
                    grace = min(grace * 2, max(POLL_GRACE, POLL_GRACE_MAX))  # polling still?
                else:
                    grace = POLL_GRACE
                self._sleep_until = now + wait
                ready = sel.select(wait)
                self._sleep_until = 0.0
                if self._stopping:
                    break
                rx = False
                for key, _ in ready:
                    if key.data == "wake":
                        try:
                            os.read(self._wake_r, 4096)
                        except OSError:
                            pass
                    else:
                        rx = True
                if not ready and standing_back and (dl is None or time.monotonic() < dl):
                    continue  # only the grace ran out: look again, without the lock
                self._step(rx)
        except BaseException as e:  # the loop itself broke: nobody may wait in vain
            if not self._stopping:
                dev.fail(e)

    def _step(self, rx: bool) -> None:
        dev = self.device
        try:
            with dev.lock:
                if rx:
                    self.transport.receive_ready()
                dev.fire_timers(time.monotonic())
                dev.run_local()
        except Exception as e:
            # One event went wrong (QP-level errors are contained below us; this is a
            # last line). Count it, log the first of each kind with its traceback, go on.
            dev.counters.progress_errors += 1
            if type(e) not in self._logged:
                self._logged.add(type(e))
                log.exception("softrdma device %s: error in the progress thread", dev.name)

    def stop(self) -> None:
        self._stopping = True
        self._wake()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5)
        _running.discard(self)
        if self.device.timers.on_change == self._on_timer_change:
            self.device.timers.on_change = None
        if self.device.on_schedule == self._on_schedule:
            self.device.on_schedule = None
        if self.device.on_blocking == self._wake:
            self.device.on_blocking = None
        lock = self.device.lock
        if lock.on_defer == self._wake:  # from now on nobody would flush a deferred post
            lock.on_defer = None
            lock.flusher = None
        self._sel.close()
        self._wake_sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


def stop_all() -> None:
    """Stop every running progress thread and close its device's sockets (at exit)."""
    for p in list(_running):
        try:
            p.device.detach()
        except Exception:  # exiting: do what can be done for the others
            pass


atexit.register(stop_all)
