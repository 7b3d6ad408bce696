"""``HwContext``: an opened libibverbs device, its queries and async events: the
implementation a ``verbs_api.Context`` holds on the libibverbs backend."""

from __future__ import annotations

import ctypes
import errno
import socket
import threading
from ctypes import byref, sizeof
from typing import Any

from ..readiness import readable
from ..completion import AsyncEvent
from ..errors import PyverbsRDMAError
from ..verbs_api import device as v_device
from ..verbs_api._check import U32, as_int
from ..verbs_api.attr import GID
from ..verbs_api.enums import (ibv_event_type as E)
from . import devices, ffi
from .common import fail

__all__ = ["HwContext", "HwDevice"]

_QP_EVENTS = {E.IBV_EVENT_QP_FATAL, E.IBV_EVENT_QP_REQ_ERR, E.IBV_EVENT_QP_ACCESS_ERR,
              E.IBV_EVENT_COMM_EST, E.IBV_EVENT_SQ_DRAINED, E.IBV_EVENT_PATH_MIG,
              E.IBV_EVENT_PATH_MIG_ERR, E.IBV_EVENT_QP_LAST_WQE_REACHED}
_SRQ_EVENTS = {E.IBV_EVENT_SRQ_ERR, E.IBV_EVENT_SRQ_LIMIT_REACHED}
_RXE_VENDOR_ID = 0xFFFFFF  # rxe's vendor_id (and vendor_part_id 0)


class HwDevice:
    """What the verbs_api code reads as ``obj.device`` for a hardware context: its name, a
    lock (``Resource.close`` takes it), and the GID table and limits when asked."""

    def __init__(self, ctx: "HwContext", name: str) -> None:
        self.name = name
        self.lock = threading.RLock()
        self._ctx = ctx
        self.fatal = None

    def pool_take(self, pool: str) -> bool:
        """Resource.__init__'s count of objects against the device's limit: the device
        keeps its own and refuses with ENOMEM itself."""
        return True

    def pool_give(self, pool: str) -> None:
        pass

    @property
    def gid_table(self) -> list[bytes]:
        """The port-1 GID table, raw (zeros for empty entries), up to the last populated
        entry: ``gid_table[i]`` is GID index ``i``, as on a soft device."""
        ents = self._ctx.query_gid_table()
        table = [bytes(16)] * (ents[-1][0] + 1 if ents else 0)
        for i, g, _ in ents:
            table[i] = g.raw
        return table

    @property
    def limits(self) -> Any:
        a = self._ctx.query_device()
        p = self._ctx.query_port(1)
        ns = type("Limits", (), {})()
        ns.__dict__.update(a.__dict__)
        ns.gid_tbl_len, ns.max_msg_sz = p.gid_tbl_len, p.max_msg_sz
        return ns


# -- Context ---------------------------------------------------------------------------------

class HwContext:
    """The libibverbs backend's context: an ``ibv_context`` opened with ``ibv_open_device``
    (or adopted), held by a ``verbs_api.Context`` (``owner``) as its ``impl``.

    Its ``extras`` are what the other hardware implementations read through the API
    context they are given (``context._addr``...), and ``num_comp_vectors``; a soft
    context has none of them."""

    extras = frozenset({"_addr", "_ops", "_objs", "_mrs", "_rxe", "num_comp_vectors"})

    @property
    def backend(self) -> Any:
        """The implementations of the objects made in this context (ibverbs'); imported
        here, not at the top, as objects.py imports this module."""
        from .objects import BACKEND
        return BACKEND

    def __init__(self, owner: Any, name: str | None) -> None:
        self.closed = True  # until open: close() must not touch anything
        self._attach(owner, *devices.open_device(name), owned=True)

    @classmethod
    def adopt(cls, addr: int) -> v_device.Context:
        """The context of an ``ibv_context*`` that another library opened and keeps
        (librdmacm's ``id->verbs``): a ``verbs_api.Context`` holding an ``HwContext``;
        ``close`` destroys what was made in it and leaves the device open."""
        def make(owner: v_device.Context) -> "HwContext":
            self = object.__new__(cls)
            self.closed = True
            dev = ffi.ibv_context.from_address(addr).device
            self._attach(owner, addr, ffi.lib().ibv_get_device_name(dev).decode(),
                         owned=False)
            return self
        return v_device.Context.holding(make)

    def _attach(self, owner: Any, addr: int, name: str, owned: bool) -> None:
        self.owner = owner
        self.name, self._addr, self._owned = name, addr, owned
        self._c = ffi.ibv_context.from_address(addr)
        self._ops = ffi.Ops(self._c)
        self._objs: dict[int, Any] = {}  # C address -> QP/CQ/SRQ object (async events, CQ events)
        self._mrs: dict[int, Any] = {}  # lkey -> MR (inline sends translate iovas)
        self.device = HwDevice(self, self.name)
        self.closed = False
        a = self.query_device()
        self._rxe = a.vendor_id == _RXE_VENDOR_ID and a.vendor_part_id == 0

    def _check(self) -> None:
        if self.closed:
            raise PyverbsRDMAError("the context is closed", errno.EBADF)

    def close(self) -> None:
        """Close the device if this context opened it (its children are gone)."""
        if self.closed:
            return
        rc = ffi.lib().ibv_close_device(self._addr) if self._owned else 0
        self.closed = True
        self._objs.clear()
        if rc:
            raise fail(f"Failed to close device {self.name}", rc)

    # -- queries ---------------------------------------------------------------------------
    def query_device(self) -> v_device.DeviceAttr:
        self._check()
        a = ffi.ibv_device_attr()
        rc = ffi.lib().ibv_query_device(self._addr, byref(a))
        if rc:
            raise fail(f"Failed to query device {self.name}", rc)
        kw = {n: getattr(a, n) for n, _ in ffi.ibv_device_attr._fields_
              if n not in ("fw_ver", "atomic_cap")}
        kw["fw_ver"] = a.fw_ver.decode(errors="replace")
        kw["atomic_caps"] = a.atomic_cap
        kw["node_guid"] = devices.byteswap64(a.node_guid)
        kw["sys_image_guid"] = devices.byteswap64(a.sys_image_guid)
        return v_device.DeviceAttr(**kw)

    def query_port(self, port_num: int = 1) -> v_device.PortAttr:
        self._check()
        port = as_int(port_num, f"Failed to query port {port_num}", "port_num", 255)
        a = ffi.ibv_port_attr()
        rc = ffi.query_port(self._c, port, a)
        if rc:
            raise fail(f"Failed to query port {port_num}", rc)
        return v_device.PortAttr(**{n: getattr(a, n) for n, _ in ffi.ibv_port_attr._fields_})

    def query_gid(self, port_num: int, index: int) -> GID:
        self._check()
        what = f"Failed to query gid {index} of port {port_num}"
        port = as_int(port_num, what, "port_num", 255)
        idx = as_int(index, what, "index", (1 << 31) - 1)
        g = ffi.ibv_gid()
        rc = ffi.lib().ibv_query_gid(self._addr, port, idx, byref(g))
        if rc:
            raise fail(what, ctypes.get_errno() or errno.EINVAL)
        return GID(bytes(g.raw))

    def _gid_entry(self, port_num: int, index: int) -> ffi.ibv_gid_entry | None:
        """``ibv_query_gid_ex``: the entry, or None for an empty one (ENODATA)."""
        what = f"Failed to query gid {index} of port {port_num}"
        e = ffi.ibv_gid_entry()
        rc = ffi.lib()._ibv_query_gid_ex(self._addr, as_int(port_num, what, "port_num", 255),
                                         as_int(index, what, "index", U32), byref(e), 0,
                                         sizeof(e))
        if rc in (errno.ENODATA, -errno.ENODATA):
            return None
        if rc:
            raise fail(what, abs(rc))
        return e

    def query_gid_type(self, port_num: int, index: int) -> int:
        self._check()
        e = self._gid_entry(port_num, index)
        if e is None:
            raise PyverbsRDMAError(f"Failed to query gid type of index {index}: empty entry",
                                   errno.ENODATA)
        return e.gid_type

    def query_gid_table(self) -> list[tuple[int, GID, int]]:
        """``(index, GID, gid type)`` for every populated entry of port 1."""
        self._check()
        out = []
        for i in range(self.query_port(1).gid_tbl_len):
            e = self._gid_entry(1, i)
            if e is not None:
                out.append((i, GID(bytes(e.gid.raw)), e.gid_type))
        return out

    def query_pkey(self, port_num: int, index: int) -> int:
        self._check()
        what = f"Failed to query pkey {index}"
        v = ffi.c_uint16()
        rc = ffi.lib().ibv_query_pkey(self._addr, as_int(port_num, what, "port_num", 255),
                                      as_int(index, what, "index", (1 << 31) - 1), byref(v))
        if rc:
            raise fail(what, ctypes.get_errno() or errno.EINVAL)
        return socket.ntohs(v.value)

    @property
    def num_comp_vectors(self) -> int:
        return self._c.num_comp_vectors

    # -- async events ----------------------------------------------------------------------
    @property
    def async_fd(self) -> int:
        """The kernel's async event fd: readable while an event is pending."""
        return self._c.async_fd

    def get_async_event(self, block: bool = True) -> AsyncEvent | None:
        """``ibv_get_async_event``, acknowledged at once (the event is copied out, so a
        later destroy never waits for it). ``block=False``: None when nothing is pending."""
        self._check()
        if not readable([self._c.async_fd], None if block else 0):
            return None
        ev = ffi.ibv_async_event()
        if ffi.lib().ibv_get_async_event(self._addr, byref(ev)):
            err = ctypes.get_errno()
            if err == errno.EAGAIN and not block:
                return None
            raise fail("Failed to get async event", err)
        try:
            t = ev.event_type
            if t == E.IBV_EVENT_CQ_ERR:
                el = self._objs.get(ev.element.cq)
            elif t in _QP_EVENTS:
                el = self._objs.get(ev.element.qp)
            elif t in _SRQ_EVENTS:
                el = self._objs.get(ev.element.srq)
            else:
                el = ev.element.port_num
            try:
                t = E(t)
            except ValueError:
                pass
            return AsyncEvent(t, el)
        finally:
            ffi.lib().ibv_ack_async_event(byref(ev))

    def __repr__(self) -> str:
        return f"<Context {self.name} (libibverbs)>"
