"""``HwCompChannel`` and ``HwCQ``: completions polled through ``context->ops.poll_cq``
(immediate data turned back to a host integer), events through the channel's fd. They are
the implementations a :class:`softrdma.verbs_api.CompChannel` / ``CQ`` holds on a device."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import os
import socket
import time
from collections import deque
from ctypes import addressof, byref, c_void_p
from typing import Any

from ..readiness import readable
from ..completion import WC
from ..errors import PyverbsRDMAError
from ..verbs_api import cq as v_cq
from ..verbs_api import device as v_device
from ..verbs_api._check import as_int
from ..verbs_api.enums import (ibv_wc_flags as WCF)
from . import ffi
from .common import fail, hw_impl, null_error
from .context import HwContext

__all__ = ["HwCompChannel", "HwCQ"]

_WC_IMM, _WC_INV = int(WCF.IBV_WC_WITH_IMM), int(WCF.IBV_WC_WITH_INV)
# Kernel rxe writes the kernel's IB_WC_WITH_INVALIDATE (1 << 2) into the completion ring
# that librxe copies out unchanged; libibverbs numbers that bit IBV_WC_IP_CSUM_OK and has
# IBV_WC_WITH_INV at 1 << 3. rxe never sets IP_CSUM_OK, so on rxe the backend reports
# bit 2 as IBV_WC_WITH_INV: a SEND_WITH_INV receive reads the same on both backends.
_WC_INV_RXE = 1 << 2


# -- completion channel and CQ ---------------------------------------------------------------

class HwCompChannel:
    """``ibv_comp_channel``; its ``fd`` (made non-blocking) works with select and asyncio."""

    extras: frozenset[str] = frozenset()

    def __init__(self, owner: Any) -> None:
        context = owner.context
        hw_impl(context, v_device.Context, HwContext, "Failed to create a completion channel",
                "context")
        c = ffi.lib().ibv_create_comp_channel(context._addr)
        if not c:
            raise null_error("Failed to create a completion channel")
        self._addr = c
        self._c = ffi.ibv_comp_channel.from_address(c)
        self.context = context
        fl = fcntl.fcntl(self._c.fd, fcntl.F_GETFL)
        fcntl.fcntl(self._c.fd, fcntl.F_SETFL, fl | os.O_NONBLOCK)  # EAGAIN, not a hang

    @property
    def fd(self) -> int:
        return self._c.fd

    def _take(self) -> Any:
        """One pending event's CQ (the API object; libibverbs' count of it kept), or None
        (EAGAIN)."""
        cq, ctxp = c_void_p(), c_void_p()
        if ffi.lib().ibv_get_cq_event(self._addr, byref(cq), byref(ctxp)):
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                return None
            raise fail("Failed to get CQ event", err)
        ev_cq = self.context._objs.get(cq.value)
        if ev_cq is None:  # a CQ destroyed meanwhile cannot have events: ack and go on
            ffi.lib().ibv_ack_cq_events(cq.value, 1)
            return None
        ev_cq.impl._hw_unacked += 1
        return ev_cq

    def get_cq_event(self, timeout: float | None = None) -> Any:
        """``ibv_get_cq_event``: the CQ of the next event. ``timeout`` seconds (None: block)
        raises ETIMEDOUT when it expires, as on the soft backend."""
        what = "Failed to get CQ event"
        deadline = None if timeout is None else time.monotonic() + timeout
        while (ev_cq := self._take()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise PyverbsRDMAError(f"{what}: timed out", errno.ETIMEDOUT)
            readable([self._c.fd], left)
        return ev_cq

    async def wait_async(self) -> Any:
        """The next event's CQ, through the loop's reader."""
        loop = asyncio.get_running_loop()
        while (ev_cq := self._take()) is None:
            fut: asyncio.Future[None] = loop.create_future()
            loop.add_reader(self._c.fd, lambda: fut.done() or fut.set_result(None))
            try:
                await fut
            finally:
                loop.remove_reader(self._c.fd)
        return ev_cq

    def destroy(self) -> None:
        rc = ffi.lib().ibv_destroy_comp_channel(self._addr)
        if rc:
            raise fail("Failed to destroy completion channel", rc)


_BATCH = 16


class HwCQ:
    """``ibv_cq``. ``poll`` goes through ``context->ops.poll_cq`` into a preallocated
    ``ibv_wc`` array and returns :class:`softrdma.completion.WC` objects, as the soft CQ."""

    extras: frozenset[str] = frozenset()

    @staticmethod
    def check_create(context: Any, cqe: Any, comp_vector: Any, what: str) -> tuple[int, int]:
        hw_impl(context, v_device.Context, HwContext, what, "context")
        return (as_int(cqe, what, "cqe", (1 << 31) - 1),
                as_int(comp_vector, what, "comp_vector", (1 << 31) - 1))

    def __init__(self, owner: Any, cqe: int, channel: Any, comp_vector: int) -> None:
        what = "Failed to create CQ"
        context = owner.context
        ch = None if channel is None else \
            hw_impl(channel, v_cq.CompChannel, HwCompChannel, what, "channel")
        c = ffi.lib().ibv_create_cq(context._addr, cqe, None,
                                    ch._addr if ch is not None else None, comp_vector)
        if not c:
            raise null_error(what)
        self._addr: int | None = c
        self._c = ffi.ibv_cq.from_address(c)
        self.context = context
        self._wcs: deque[WC] = deque()  # polled from the device, not yet handed out
        self._arr = (ffi.ibv_wc * _BATCH)()
        self._arr_addr = addressof(self._arr)
        self._poll_cq = context._ops.poll_cq
        self._inv_bit = _WC_INV_RXE if context._rxe else _WC_INV
        self._hw_unacked = 0  # events libibverbs has not been told of (acked at destroy)
        context._objs[c] = owner  # CQ events and async events name the API object

    @property
    def cqe(self) -> int:
        return self._c.cqe
    def _fill(self, want: int) -> None:
        """Move up to ``want`` completions from the device into ``self._wcs``."""
        while want > 0:
            n = self._poll_cq(self._addr, min(want, _BATCH), self._arr_addr)
            if n < 0:
                raise fail("Failed to poll CQ", -n)
            self._convert(n)
            if n < min(want, _BATCH):
                return
            want -= n

    def _convert(self, n: int) -> None:
        """Append the first ``n`` polled ``ibv_wc`` as :class:`WC` objects to ``_wcs``."""
        arr, q = self._arr, self._wcs
        for i in range(n):
            c = arr[i]
            flags = c.wc_flags
            if flags & self._inv_bit and self._inv_bit != _WC_INV:
                flags = flags & ~_WC_INV_RXE | _WC_INV  # see _WC_INV_RXE
            imm = socket.ntohl(c.imm_data) if flags & _WC_IMM else \
                c.imm_data if flags & _WC_INV else 0
            wc = WC(c.wr_id, c.status, c.opcode, c.vendor_err, c.byte_len, c.qp_num,
                    c.src_qp, imm, flags, c.pkey_index, c.slid, c.sl, c.dlid_path_bits)
            if flags & _WC_INV:
                wc.invalidated_rkey = c.imm_data
            q.append(wc)

    def poll(self, num_entries: int = 1) -> tuple[int, list[WC]]:
        """Up to ``num_entries`` completions, oldest first: ``(count, [WC, ...])``."""
        q = self._wcs
        if not q and 0 < num_entries <= _BATCH:
            # the common case, kept short: one provider call, nothing held back
            n = self._poll_cq(self._addr, num_entries, self._arr_addr)
            if n <= 0:
                if n < 0:
                    raise fail("Failed to poll CQ", -n)
                return 0, []
            self._convert(n)
            out = list(q)
            q.clear()
            return n, out
        if len(q) < num_entries:
            self._fill(num_entries - len(q))
        out = [q.popleft() for _ in range(min(num_entries, len(q)))]
        return len(out), out

    def __len__(self) -> int:
        """Completions ready now (polled from the device and kept for the next poll)."""
        if self._addr is not None:  # (not once destroyed)
            self._fill(1 << 30)
        return len(self._wcs)

    def req_notify(self, solicited_only: bool = False) -> None:
        rc = self.context._ops.req_notify_cq(self._addr, 1 if solicited_only else 0)
        if rc:
            raise fail("Failed to request notification", rc)

    def ack_events(self, num_events: int) -> None:
        """Tell libibverbs of acks for events it counted (the API checked the number)."""
        n = min(num_events, self._hw_unacked)
        if n:
            ffi.lib().ibv_ack_cq_events(self._addr, n)
            self._hw_unacked -= n

    def resize(self, cqe: int) -> None:
        cqe = as_int(cqe, "Failed to resize CQ", "cqe", (1 << 31) - 1)
        rc = ffi.lib().ibv_resize_cq(self._addr, cqe)
        if rc:
            raise fail(f"Failed to resize CQ to {cqe}", rc)

    def destroy(self) -> None:
        if self._hw_unacked:  # ibv_destroy_cq waits for every event to be acked
            ffi.lib().ibv_ack_cq_events(self._addr, self._hw_unacked)
            self._hw_unacked = 0
        rc = ffi.lib().ibv_destroy_cq(self._addr)
        if rc:
            raise fail("Failed to destroy CQ", rc)
        self.context._objs.pop(self._addr, None)
        self._addr = None

    def describe(self, closed: bool) -> str:
        return f"<CQ cqe={self.cqe} (libibverbs)>" if not closed else "<CQ closed>"
