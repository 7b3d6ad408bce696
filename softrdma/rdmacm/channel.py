"""``struct rdma_event_channel``: where the events of an rdma_cm id arrive.

A channel is a queue of :class:`~softrdma.rdmacm.events.RdmaCmEvent` with a file
descriptor that is readable while an event waits. Waiting on a channel whose ids use a
manual device (no progress thread) moves that device: the device's own
:meth:`~softrdma.soft.device.SoftDevice.step` does it, so the channel never touches a
device's clock.

Taking a CONNECT_REQUEST (:meth:`EventChannel.get`, the one way events leave a channel)
gives its listener room for one more request (the listener's backlog, as Linux's
``ucma_get_event`` does). A CONNECT_REQUEST whose id is gone (its listener was destroyed
first) is not reported, as Linux removes those events with the listener.
"""

from __future__ import annotations

import errno
import time
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import PyverbsRDMAError
from ..verbs_api.events import EventQueue
from .enums import rdma_cm_event_type as E
from .events import RdmaCmEvent

if TYPE_CHECKING:  # the id module imports this one
    from .cm_id import RdmaCmId

__all__ = ["EventChannel", "ManualDevice"]


class ManualDevice(Protocol):
    """What the channel needs of a device it moves while waiting (a soft device)."""

    udp: Any  # its sockets, None without
    progress_thread: Any  # None when nothing moves it but its callers

    def step(self, jump_to_timer: bool = True) -> bool:
        """Handle what is due (waiting briefly for packets); with ``jump_to_timer`` a
        device without sockets may skip its virtual clock to its next timer. False when
        nothing happened."""
        ...


class EventChannel:
    """``struct rdma_event_channel``: the queue of events of the ids created on it. Its
    :attr:`fd` is readable while an event waits (select, poll, asyncio)."""

    def __init__(self) -> None:
        self._queue = EventQueue()
        self._watched: set[ManualDevice] = set()  # manual devices: waiting means moving them
        self.ids: set["RdmaCmId"] = set()  # the ids whose events come here
        self.closed = False

    @property
    def fd(self) -> int:
        return self._queue.fd

    def put(self, event: RdmaCmEvent) -> None:
        self._queue.put(event)

    def watch(self, device: ManualDevice) -> None:
        """An id of this channel uses ``device``: if nothing else moves it (no progress
        thread), waiting on the channel will."""
        self._watched.add(device)

    def manual_devices(self) -> list[ManualDevice]:
        """The watched devices that have no progress thread now (they go live later)."""
        return [d for d in self._watched if d.udp is None or d.progress_thread is None]

    def get(self, timeout: float | None = None) -> RdmaCmEvent:
        """The next event (``rdma_get_cm_event``); blocks up to ``timeout`` seconds (None:
        for ever). ETIMEDOUT when none comes; EBADF once closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.closed:
                raise PyverbsRDMAError("rdma_get_cm_event: the event channel is closed",
                                       errno.EBADF)
            ev = self._queue.get()
            if ev is not None and ev.event == E.RDMA_CM_EVENT_CONNECT_REQUEST:
                if ev.id.destroyed:  # went with its listener: not the application's
                    continue
                if ev.listen_id is not None:
                    ev.listen_id.connect_request_taken(ev.id)
            if ev is not None:
                return ev
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise PyverbsRDMAError("rdma_get_cm_event: no event", errno.ETIMEDOUT)
            manual = self.manual_devices()
            if manual:
                if not self._drive(manual):
                    time.sleep(0.001)
                continue
            self._queue.wait(None if left is None else time.monotonic() + min(left, 1.0))

    def _drive(self, devices: list[ManualDevice]) -> bool:
        """Waiting on manual devices means moving them; a device's virtual clock may jump
        to its next timer only while no event waits here. False when nothing moved."""
        moved = False
        for dev in devices:
            moved |= dev.step(jump_to_timer=not self._queue)
        return moved

    def wait(self, timeout: float | None) -> None:
        """Block until an event is queued or ``timeout`` seconds pass (None: no limit; a
        negative timeout counts as 0); no event is taken. With a manual device it moves
        the device one step instead and returns (the caller's loop, which may have
        completions to handle, comes round again before virtual time moves on)."""
        if self._queue:
            return
        manual = self.manual_devices()
        if manual:
            self._drive(manual)
            return
        self._queue.wait(None if timeout is None else time.monotonic() + max(0.0, timeout))

    def pending(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        """Close the channel and destroy the ids still on it (what the kernel does when
        the rdma_cm file closes): a connection request nobody took is rejected."""
        if not self.closed:
            self.closed = True
            for cid in list(self.ids):
                cid.destroy()
            self._queue.close()

    def adopt(self, cid: "RdmaCmId") -> None:
        """``rdma_migrate_id``: ``cid``'s events come here from now on, and those it has
        waiting on its old channel move with it, in order (``ucma_migrate_id``). Its own
        events are the ones about it, and for a listener the connection requests it
        received; a child's CONNECT_REQUEST stays: it is its listener's event."""
        old = cid.channel
        old.ids.discard(cid)
        self._watched |= old._watched
        cid.channel = self
        self.ids.add(cid)
        if old is not self:
            for ev in old._queue.take_where(lambda ev: (
                    ev.listen_id is cid if ev.event == E.RDMA_CM_EVENT_CONNECT_REQUEST
                    else ev.id is cid)):
                self.put(ev)
