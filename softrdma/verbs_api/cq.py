"""Completion queues and completion channels.

``CQ(ctx, cqe, cq_context=None, channel=None, comp_vector=0)``. The capacity is ``cqe``
rounded up the way rxe sizes its rings (a power of two minus one: 100 -> 127), reported in
``cq.cqe``. When a completion arrives to a full CQ it is dropped, the CQ enters the error
state and an IBV_EVENT_CQ_ERR async event is raised, as in rxe.

Notification: ``cq.req_notify(solicited_only=False)`` arms the CQ once; the next completion
(or, when solicited only, the next solicited completion) writes an event to the CQ's
:class:`CompChannel`, whose ``fd`` becomes readable. ``channel.get_cq_event()`` returns the
CQ; every event must eventually be acknowledged with ``cq.ack_events(n)``::

    ch = CompChannel(ctx); cq = CQ(ctx, 16, None, ch, 0)
    cq.req_notify()
    ...                              # select([ch.fd], [], []) or await ch.wait_async()
    ev_cq = ch.get_cq_event(cq); cq.ack_events(1); cq.req_notify()
    for wc in cq.poll_all(): ...

:class:`CQ` and :class:`CompChannel` are the API on both backends; each holds its
backend's implementation: :class:`SoftCQ` (the ring the soft engines push completions
into) and :class:`SoftCompChannel` here, ``HwCQ``/``HwCompChannel`` in
:mod:`softrdma.ibverbs.completion`.
"""

from __future__ import annotations

import errno
import time
from collections import deque
from typing import Any, Iterator

from ..completion import AsyncEvent
from ..errors import PyverbsRDMAError
from ._check import kind, U32, as_int, require
from .base import ContextBase, Sibling
from .events import EventQueue
from .enums import ibv_event_type
from .wr import WC

__all__ = ["CQ", "CompChannel", "SoftCQ", "SoftCompChannel", "ring_size"]


def _trace_wc(dev: Any, wc: WC) -> None:
    """The trace's line for a completion (softrdma.trace, kind ``cq``)."""
    from .enums import ibv_wc_opcode, ibv_wc_status
    try:
        op = ibv_wc_opcode(wc.opcode).name[7:]
    except ValueError:
        op = str(wc.opcode)
    st = ibv_wc_status(wc.status).name[7:]
    dev.trace.emit(dev, "cq", wc.qp_num, f"completion {op} wr_id={wc.wr_id} {st} "
                                         f"byte_len={wc.byte_len}", wr_id=wc.wr_id,
                   status=st, opcode=op, byte_len=wc.byte_len)


def ring_size(n: int) -> int:
    """rxe_queue_init: slots = roundup_pow_of_two(n + 1); usable = slots - 1."""
    return (1 << n.bit_length()) - 1 if n > 0 else 0


class CompChannel(Sibling):
    """``ibv_comp_channel``: a file descriptor that becomes readable when an armed CQ of
    this channel gets a completion. Works with select/poll/epoll and asyncio."""

    _kind = "completion channel"

    def __init__(self, context: Any) -> None:
        self._create(context, "CompChannel")

    @property
    def fd(self) -> int:
        return self.impl.fd

    def get_cq_event(self, cq: "CQ | None" = None, timeout: float | None = None) -> "CQ":
        """Wait for the next CQ event (ibv_get_cq_event) and return its CQ. ``timeout`` in
        seconds (None blocks, as libibverbs does) raises ETIMEDOUT when it expires; a
        device whose progress stopped raises EIO rather than blocking forever."""
        self._check()
        ev_cq = self.impl.get_cq_event(timeout)
        ev_cq._events_unacked += 1
        if cq is not None and ev_cq is not cq:
            raise PyverbsRDMAError("Failed to get CQ event: the event is for another CQ",
                                   errno.EINVAL)
        return ev_cq

    async def wait_async(self) -> "CQ":
        """``await channel.wait_async()``: the asyncio form of get_cq_event."""
        self._check()
        ev_cq = await self.impl.wait_async()
        ev_cq._events_unacked += 1
        return ev_cq


class SoftCompChannel:
    """A soft channel: a queue of CQs whose fd is readable while one is pending."""

    extras = frozenset({"notify", "wake"})

    def __init__(self, owner: CompChannel) -> None:
        self.owner = owner
        self.device = owner.device
        self._events = EventQueue()  # of CQs; the fd is readable while one is pending

    @property
    def closed(self) -> bool:
        return self.owner.closed

    @property
    def fd(self) -> int:
        return self._events.fd

    def notify(self, cq: "CQ") -> None:
        """An armed CQ of this channel got a completion (called by the CQ)."""
        self._events.put(cq)

    def wake(self) -> None:
        """The device failed: wake a blocked waiter so it learns it."""
        self._events.wake()

    def _fatal(self, what: str) -> None:
        if self.device.fatal is not None:
            raise PyverbsRDMAError(f"{what}: device {self.device.name} stopped "
                                   f"({self.device.fatal!r})", errno.EIO)

    def get_cq_event(self, timeout: float | None = None) -> "CQ":
        what = "Failed to get CQ event"
        deadline = None if timeout is None else time.monotonic() + timeout
        while (ev_cq := self._events.get()) is None:
            self._fatal(what)
            self.device.blocking()  # the progress thread receives while we wait
            if deadline is not None and time.monotonic() >= deadline:
                raise PyverbsRDMAError(f"{what}: timed out", errno.ETIMEDOUT)
            self._events.wait(deadline)
        return ev_cq

    async def wait_async(self) -> "CQ":
        while not len(self._events):
            self._fatal("Failed to get CQ event")
            self.device.blocking()  # the progress thread receives while we wait
            await self._events.wait_async()
        return self.get_cq_event()

    def destroy(self) -> None:
        self._events.close()


class CQ(Sibling):
    """``ibv_cq``: where completions of work requests are polled."""

    _kind = "CQ"
    _pool = "cq"

    def __init__(self, context: Any, cqe: int, cq_context: Any = None,
                 channel: CompChannel | None = None, comp_vector: int = 0) -> None:
        what = "Failed to create CQ"
        if not isinstance(context, ContextBase):
            raise PyverbsRDMAError(f"{what}: context is {kind(context)}, not a Context",
                                   errno.EINVAL)
        context._check()
        cqe, comp_vector = context.backend.CQ.check_create(context, cqe, comp_vector, what)
        require(channel, CompChannel, what, "channel", optional=True)
        if channel is not None:
            channel._check()
        self._create(context, "CQ", cqe, channel, comp_vector)
        self.cq_context = cq_context
        self.channel = channel
        self._events_unacked = 0  # CQ events got from the channel and not acked yet
        self._use(channel)

    @property
    def cqe(self) -> int:
        """The capacity (what the device made of the ``cqe`` asked for)."""
        return self.impl.cqe

    def poll(self, num_entries: int = 1) -> tuple[int, list[WC]]:
        """Up to ``num_entries`` completions, oldest first: ``(count, [WC, ...])`` as pyverbs."""
        if self.closed:
            self._check()
        return self.impl.poll(num_entries)

    def poll_all(self) -> list[WC]:
        """Every completion now in the CQ."""
        self._check()
        return self.poll(len(self.impl) or 1)[1]

    def __iter__(self) -> Iterator[WC]:
        """Iterate over the completions currently in the CQ (does not wait)."""
        while True:
            n, wcs = self.poll(1)
            if not n:
                return
            yield wcs[0]

    def __len__(self) -> int:
        """Completions ready now."""
        return len(self.impl)

    def __bool__(self) -> bool:
        # A CQ is always truthy, even when empty (len 0): ``scq = cq or default_cq`` must
        # not silently swap an empty CQ for another one.
        return True

    def req_notify(self, solicited_only: bool = False) -> None:
        """Arm the CQ once: its next completion (or next solicited one) is an event on
        its channel."""
        self._check()
        self.impl.req_notify(solicited_only)

    def ack_events(self, num_events: int) -> None:
        num_events = as_int(num_events, "Failed to ack CQ events", "num_events", U32)
        if num_events > self._events_unacked:
            raise PyverbsRDMAError(f"Failed to ack {num_events} CQ events: only "
                                   f"{self._events_unacked} unacknowledged", errno.EINVAL)
        self._events_unacked -= num_events
        self.impl.ack_events(num_events)

    def resize(self, cqe: int) -> None:
        """ibv_resize_cq: EINVAL if ``cqe`` is out of range or below the completions held."""
        self._check()
        self.impl.resize(cqe)

    def close(self) -> None:
        if not self.closed and self._events_unacked:
            # ibv_destroy_cq would wait forever for the acks; say why instead.
            raise PyverbsRDMAError(f"Failed to destroy CQ: {self._events_unacked} CQ events "
                                   f"not acknowledged (ack_events)", errno.EBUSY)
        super().close()

    def _parents(self) -> tuple[Any, ...]:
        return (self.channel,)

    def __repr__(self) -> str:
        return self.impl.describe(self.closed)


class SoftCQ:
    """A soft CQ: the ring the engines push completions into (they hold this object)."""

    extras = frozenset({"push", "error"})

    @staticmethod
    def check_create(context: Any, cqe: Any, comp_vector: Any, what: str) -> tuple[int, int]:
        """rxe_cq_chk_attr: 1 <= cqe <= max_cqe; one completion vector."""
        cqe = as_int(cqe, what, "cqe", context.device.limits.max_cqe, 1)
        comp_vector = as_int(comp_vector, what, "comp_vector", (1 << 31) - 1,
                             desc=">= num_comp_vectors (1)")
        if comp_vector != 0:
            raise PyverbsRDMAError(f"{what}: comp_vector {comp_vector} >= num_comp_vectors (1)",
                                   errno.EINVAL)
        return cqe, comp_vector

    def __init__(self, owner: CQ, cqe: int, channel: CompChannel | None,
                 comp_vector: int) -> None:
        self.owner = owner  # the CQ that events and the channel name
        self.device = owner.device
        self.channel = None if channel is None else channel.impl
        self.cqe = ring_size(cqe)
        self._wcs: deque[WC] = deque()
        self._armed = 0  # 0 off, 1 next completion, 2 next solicited completion
        self.error = False

    @property
    def closed(self) -> bool:
        return self.owner.closed

    # -- producer side (engines) -------------------------------------------------------
    def push(self, wc: WC, solicited: bool = False) -> bool:
        """Add a completion (called by the engines with the device lock held)."""
        if self.owner.closed:
            return False
        if len(self._wcs) >= self.cqe:
            if not self.error:
                self.error = True
                self.device.emit_async(AsyncEvent(ibv_event_type.IBV_EVENT_CQ_ERR, self.owner))
            return False
        self._wcs.append(wc)
        if self.device.trace is not None:
            _trace_wc(self.device, wc)
        if self._armed == 1 or (self._armed == 2 and solicited):
            self._armed = 0
            if self.channel is not None and not self.channel.closed:
                self.channel.notify(self.owner)
        return True

    # -- consumer side -----------------------------------------------------------------
    def poll(self, num_entries: int = 1) -> tuple[int, list[WC]]:
        out: list[WC] = []
        dev = self.device
        if not self._wcs and dev.udp is not None:
            # the caller is waiting for completions: make progress on its own thread
            try:
                dev.poll_nowait()
            except OSError as e:
                raise PyverbsRDMAError(f"Failed to poll CQ: {e.strerror or e}",
                                       e.errno or errno.EIO) from None
        with dev.lock:
            q = self._wcs
            while q and len(out) < num_entries:
                out.append(q.popleft())
        if dev.udp is not None:
            # the program polls: in manual mode its next post may defer its flush to the
            # next poll (doorbell batching, softrdma.soft.lock); any other hold clears this
            dev.lock.polling = True
        return len(out), out

    def __len__(self) -> int:
        return len(self._wcs)

    def req_notify(self, solicited_only: bool = False) -> None:
        with self.device.lock:
            self._armed = 2 if solicited_only and self._armed != 1 else 1

    def ack_events(self, num_events: int) -> None:
        pass  # the count is the API object's

    def resize(self, cqe: int) -> None:
        lim = self.device.limits
        cqe = as_int(cqe, "Failed to resize CQ", "cqe", U32)
        with self.device.lock:
            if cqe <= 0 or cqe > lim.max_cqe or cqe < len(self._wcs):
                raise PyverbsRDMAError(f"Failed to resize CQ to {cqe}: must be 1..{lim.max_cqe} "
                                       f"and hold the {len(self._wcs)} completions queued",
                                       errno.EINVAL)
            self.cqe = ring_size(cqe)

    def destroy(self) -> None:
        pass

    def describe(self, closed: bool) -> str:
        return f"<CQ cqe={self.cqe} queued={len(self._wcs)}>"
