"""The progress engine: what makes a soft device move on its own, like a NIC.

A :class:`Progress` thread waits (``select``) on the device's socket and a wake-up pipe,
delivers arriving packets to the engines, and fires the QPs' timers on time. Verbs calls
run on the caller's thread under the device lock (``post_send`` sends at once); the thread
only does what nobody asked for: receive and time out. ``stop()`` joins it.

Manual mode (``SoftDevice.attach_udp(..., thread=False)``) has no thread: the program
calls ``device.poll(timeout)`` to make progress, deterministically.
"""

from __future__ import annotations

import os
import select
import threading
import time
from typing import Any

__all__ = ["Progress", "poll_once"]

MAX_SLEEP = 0.05  # seconds; bounds the wait when no timer is armed


def poll_once(device: Any, transport: Any, timeout: float) -> int:
    """Wait up to ``timeout`` for packets or the next timer, handle them; return events."""
    with device.lock:
        dl = device.next_deadline()
    now = time.monotonic()
    wait = timeout if dl is None else max(0.0, min(timeout, dl - now))
    r, _, _ = select.select([transport.fileno()], [], [], wait)
    n = 0
    with device.lock:
        if r:
            n += transport.receive_ready()
        n += device.fire_timers(time.monotonic())
    return n


class Progress(threading.Thread):
    def __init__(self, device: Any, transport: Any) -> None:
        super().__init__(name=f"softrdma-progress-{device.name}", daemon=True)
        self.device = device
        self.transport = transport
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._stopping = False
        self._sleep_until = 0.0
        device.on_timer_change = self._on_timer_change

    def _on_timer_change(self, deadline: float | None) -> None:
        # a timer armed earlier than our wake-up time: wake the thread to re-plan
        if deadline is not None and deadline < self._sleep_until:
            try:
                os.write(self._wake_w, b"t")
            except OSError:
                pass

    def run(self) -> None:
        dev = self.device
        tr = self.transport
        fds = [tr.fileno(), self._wake_r]
        while not self._stopping:
            with dev.lock:
                dl = dev.next_deadline()
            now = time.monotonic()
            wait = MAX_SLEEP if dl is None else max(0.0, min(MAX_SLEEP, dl - now))
            self._sleep_until = now + wait
            try:
                r, _, _ = select.select(fds, [], [], wait)
            except (OSError, ValueError):
                break
            self._sleep_until = 0.0
            if self._stopping:
                break
            if self._wake_r in r:
                try:
                    os.read(self._wake_r, 4096)
                except OSError:
                    pass
            with dev.lock:
                if fds[0] in r:
                    tr.receive_ready()
                dev.fire_timers(time.monotonic())

    def stop(self) -> None:
        self._stopping = True
        try:
            os.write(self._wake_w, b"s")
        except OSError:
            pass
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5)
        self.device.on_timer_change = None
        os.close(self._wake_r)
        os.close(self._wake_w)
