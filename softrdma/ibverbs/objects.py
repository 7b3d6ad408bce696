"""The verbs_api classes on a libibverbs device: ``HwContext``, ``HwPD``, ``HwMR``, ``HwMW``,
``HwCQ``, ``HwCompChannel``, ``HwSRQ``, ``HwAH``, ``HwQP``.

Each subclasses the verbs_api class it implements (``HwPD(verbs_api.PD)``) and overrides
everything that would reach the soft device's engines; what is pure API (``QP.to_rts``'s
masks, ``MR.read``/``write`` over ``mr.mem``, ``CQ.__iter__``, ``Resource.close``'s
EBUSY-if-used rule) is inherited unchanged, so both backends behave alike. Users never
name these classes: ``verbs_api.PD(hw_context)`` returns one (see :mod:`.dispatch`).

Errors are ``PyverbsRDMAError`` with the errno libibverbs reports: a NULL from a
create/alloc/reg verb takes ``errno``; a non-zero ``int`` result is itself the errno
(``modify_qp``, ``post_send``, ``destroy_*``...); ``poll_cq`` < 0 gives ``-rc``.

Two decisions keep one program's meaning on both backends:

* **Immediate data** is a host integer, sent big-endian on the wire (softrdma's meaning:
  ``imm_data=0x11223344`` puts bytes ``11 22 33 44`` in the ImmDt header). verbs.h
  declares it ``__be32``, so the backend stores ``htonl(imm_data)`` when posting
  ``*_WITH_IMM`` and reports ``ntohl`` of it when polling a completion with
  ``IBV_WC_WITH_IMM``. ``invalidate_rkey`` / ``invalidated_rkey`` are host-order
  ``uint32_t`` in C too and are not swapped.
* **An MR's address is its iova.** ``MR(pd, length, access, address=iova, buffer=obj)``
  registers the buffer's real memory with ``ibv_reg_mr_iova2(pd, ptr, len, iova, access)``:
  SGEs, ``remote_addr`` and peers use the iova, as on the soft device. Without ``address``
  the iova is the buffer's real address (``ibv_reg_mr``). Inline sends, which the provider
  copies from the SGE address as a pointer, have their SGE addresses translated back to
  the real memory through the MR named by the lkey.

Lifetime: an MR holds its Python buffer (through a ctypes ``from_buffer`` array, which
pins the object: a registered ``bytearray`` cannot be resized, an ``mmap`` cannot be
closed) until ``ibv_dereg_mr``; memory freed while registered would be silently
overwritten by later RDMA. ``Context.close`` destroys children in the order QP -> SRQ ->
AH -> MW -> MR -> CQ -> channel -> PD, acknowledging CQ events before ``ibv_destroy_cq``
(which would otherwise wait for them forever).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import mmap
import os
import select
import socket
import threading
import time
from collections import deque
from ctypes import addressof, byref, c_void_p, sizeof
from typing import Any, Iterable

from ..completion import WC, AsyncEvent
from ..errors import PyverbsRDMAError
from ..verbs_api import ah as v_ah, cq as v_cq, device as v_device, mr as v_mr, pd as v_pd
from ..verbs_api import qp as v_qp, srq as v_srq
from ..verbs_api.base import Resource
from ..verbs_api._check import U24, U32, U64, as_int, require
from ..verbs_api.attr import GID, QPAttr, QPInitAttr, SrqAttr, SrqInitAttr
from ..verbs_api.enums import (ibv_event_type as E, ibv_mw_type, ibv_qp_attr_mask as M,
                               ibv_qp_type as T, ibv_wc_flags as WCF, ibv_wr_opcode as W)
from ..verbs_api.posting import check_wr_arg, mark_bad, sge_list, wr_chain
from ..verbs_api.wr import MWBindInfo, RecvWR, SendWR
from . import convert, devices, dispatch, ffi

__all__ = ["HwContext", "HwPD", "HwMR", "HwMW", "HwCQ", "HwCompChannel", "HwSRQ", "HwAH",
           "HwQP", "HwDevice"]

_WC_IMM, _WC_INV = int(WCF.IBV_WC_WITH_IMM), int(WCF.IBV_WC_WITH_INV)
_IMM_OPS = {int(W.IBV_WR_SEND_WITH_IMM), int(W.IBV_WR_RDMA_WRITE_WITH_IMM)}
_INV_OPS = {int(W.IBV_WR_SEND_WITH_INV), int(W.IBV_WR_LOCAL_INV)}
_RDMA_OPS = {int(W.IBV_WR_RDMA_WRITE), int(W.IBV_WR_RDMA_WRITE_WITH_IMM), int(W.IBV_WR_RDMA_READ)}
_ATOMIC_OPS = {int(W.IBV_WR_ATOMIC_CMP_AND_SWP), int(W.IBV_WR_ATOMIC_FETCH_AND_ADD)}
_BIND = int(W.IBV_WR_BIND_MW)
_INLINE = 1 << 3  # IBV_SEND_INLINE
_SEND_FLAGS = 0x1F
_ALL_QP_ATTRS = (1 << 21) - 1  # what query() asks for when given no mask
_QP_EVENTS = {E.IBV_EVENT_QP_FATAL, E.IBV_EVENT_QP_REQ_ERR, E.IBV_EVENT_QP_ACCESS_ERR,
              E.IBV_EVENT_COMM_EST, E.IBV_EVENT_SQ_DRAINED, E.IBV_EVENT_PATH_MIG,
              E.IBV_EVENT_PATH_MIG_ERR, E.IBV_EVENT_QP_LAST_WQE_REACHED}
_SRQ_EVENTS = {E.IBV_EVENT_SRQ_ERR, E.IBV_EVENT_SRQ_LIMIT_REACHED}


def _fail(what: str, code: int) -> PyverbsRDMAError:
    return PyverbsRDMAError(what, code or errno.EIO)


def _null(what: str) -> PyverbsRDMAError:
    """The error of a verb that returned NULL: errno says why."""
    return _fail(what, ctypes.get_errno())


class HwDevice:
    """What the verbs_api code reads as ``obj.device`` for a hardware context: its name, a
    lock (``Resource.close`` takes it), and the GID table and limits when asked."""

    def __init__(self, ctx: "HwContext", name: str) -> None:
        self.name = name
        self.lock = threading.RLock()
        self._ctx = ctx
        self.fatal = None

    @property
    def gid_table(self) -> list[bytes]:
        """The port-1 GID table, raw, up to the last populated entry."""
        return [e[1].raw for e in self._ctx.query_gid_table()]

    @property
    def limits(self) -> Any:
        a = self._ctx.query_device()
        p = self._ctx.query_port(1)
        ns = type("Limits", (), {})()
        ns.__dict__.update(a.__dict__)
        ns.gid_tbl_len, ns.max_msg_sz = p.gid_tbl_len, p.max_msg_sz
        return ns


def _register(obj: Any, context: "HwContext") -> None:
    """What Resource.__init__ does for a soft object, without the soft device."""
    obj.context = context
    obj.device = context.device
    obj.closed = False
    obj.users = set()
    context.children[obj] = None


def _unregister(obj: Any) -> None:
    obj.closed = True
    obj.context.children.pop(obj, None)


def _hw_parent(obj: Any, cls: type, what: str, field: str) -> Any:
    require(obj, cls, what, field)
    obj._check()
    return obj


# -- Context ---------------------------------------------------------------------------------

class HwContext(v_device.Context):
    """An ``ibv_context`` opened with ``ibv_open_device``."""

    _hw_variant = staticmethod(dispatch.variant)

    def __init__(self, name: str | bytes | None = None) -> None:
        if name is not None and not isinstance(name, (str, bytes)):
            raise PyverbsRDMAError(f"Failed to open device: name must be a str, not "
                                   f"{type(name).__name__}", errno.EINVAL)
        if isinstance(name, bytes):
            name = name.decode()
        self.closed = True  # until open: __del__ and close() must not touch anything
        self.children: dict[Any, None] = {}
        addr, self.name = devices.open_device(name)
        self._addr = addr
        self._c = ffi.ibv_context.from_address(addr)
        self._ops = ffi.Ops(self._c)
        self._objs: dict[int, Any] = {}  # C address -> QP/CQ/SRQ object (async events, CQ events)
        self._mrs: dict[int, Any] = {}  # lkey -> MR (inline sends translate iovas)
        self.device = HwDevice(self, self.name)
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        errs = []
        for k in (v_qp.QP, v_srq.SRQ, v_ah.AH, v_mr.MW, v_mr.MR, v_cq.CQ, v_cq.CompChannel,
                  v_pd.PD):
            for obj in [c for c in self.children if isinstance(c, k)]:
                try:
                    obj._destroy()
                except PyverbsRDMAError as e:  # keep going: the context is going away
                    errs.append(e)
        rc = ffi.lib().ibv_close_device(self._addr)
        self.closed = True
        self._objs.clear()
        if rc:
            raise _fail(f"Failed to close device {self.name}", rc)
        if errs:
            raise errs[0]

    # -- queries ---------------------------------------------------------------------------
    def query_device(self) -> v_device.DeviceAttr:
        self._check()
        a = ffi.ibv_device_attr()
        rc = ffi.lib().ibv_query_device(self._addr, byref(a))
        if rc:
            raise _fail(f"Failed to query device {self.name}", rc)
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
            raise _fail(f"Failed to query port {port_num}", rc)
        return v_device.PortAttr(**{n: getattr(a, n) for n, _ in ffi.ibv_port_attr._fields_})

    def query_gid(self, port_num: int, index: int) -> GID:
        self._check()
        what = f"Failed to query gid {index} of port {port_num}"
        port = as_int(port_num, what, "port_num", 255)
        idx = as_int(index, what, "index", (1 << 31) - 1)
        g = ffi.ibv_gid()
        rc = ffi.lib().ibv_query_gid(self._addr, port, idx, byref(g))
        if rc:
            raise _fail(what, ctypes.get_errno() or errno.EINVAL)
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
            raise _fail(what, abs(rc))
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
            raise _fail(what, ctypes.get_errno() or errno.EINVAL)
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
        if not select.select([self._c.async_fd], [], [], None if block else 0)[0]:
            return None
        ev = ffi.ibv_async_event()
        if ffi.lib().ibv_get_async_event(self._addr, byref(ev)):
            err = ctypes.get_errno()
            if err == errno.EAGAIN and not block:
                return None
            raise _fail("Failed to get async event", err)
        try:
            t = ev.event_type
            if t == E.IBV_EVENT_CQ_ERR:
                el = self._objs.get(ctypes.cast(ev.element.cq, c_void_p).value)
            elif t in _QP_EVENTS:
                el = self._objs.get(ctypes.cast(ev.element.qp, c_void_p).value)
            elif t in _SRQ_EVENTS:
                el = self._objs.get(ctypes.cast(ev.element.srq, c_void_p).value)
            else:
                el = ev.element.port_num
            try:
                t = E(t)
            except ValueError:
                pass
            return AsyncEvent(t, el)
        finally:
            ffi.lib().ibv_ack_async_event(byref(ev))

    def _on_fatal(self, exc: BaseException) -> None:  # soft-device hook: never called here
        pass

    def __repr__(self) -> str:
        return f"<Context {self.name} (libibverbs)>"


# -- PD --------------------------------------------------------------------------------------

class HwPD(v_pd.PD):
    _hw_variant = staticmethod(dispatch.variant)

    def __init__(self, context: Any) -> None:
        _hw_parent(context, HwContext, "Failed to alloc PD", "context")
        addr = ffi.lib().ibv_alloc_pd(context._addr)
        if not addr:
            raise _null("Failed to alloc PD")
        self._addr = addr
        _register(self, context)

    def _destroy(self) -> None:
        if self.closed:
            return
        rc = ffi.lib().ibv_dealloc_pd(self._addr)
        if rc:
            raise _fail("Failed to dealloc PD", rc)
        _unregister(self)

    def __repr__(self) -> str:
        return f"<PD on {self.device.name}>"


# -- MR and MW -------------------------------------------------------------------------------

def _writable_view(buffer: Any, what: str) -> memoryview:
    """A flat, writable byte view of ``buffer`` (EINVAL if it has no buffer or is not
    contiguous; EFAULT if read-only: libibverbs needs memory the device may write)."""
    try:
        mv = memoryview(buffer)
    except TypeError:
        raise PyverbsRDMAError(f"{what}: buffer of type {type(buffer).__name__} does not "
                               f"expose the buffer protocol", errno.EINVAL) from None
    if not mv.c_contiguous:
        raise PyverbsRDMAError(f"{what}: buffer is not C-contiguous", errno.EINVAL)
    if mv.readonly:
        raise PyverbsRDMAError(f"{what}: buffer is read-only ({type(buffer).__name__}); the "
                               f"ibverbs backend registers writable memory only", errno.EFAULT)
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


class HwMR(v_mr.MR):
    """``ibv_mr`` over a Python buffer. ``buf`` is the iova (see the module's docstring)."""

    _hw_variant = staticmethod(dispatch.variant)

    def __init__(self, pd: Any, length: int = 0, access: int = 0, address: int | None = None,
                 implicit: bool = False, *, buffer: Any = None) -> None:
        what = "Failed to register MR"
        _hw_parent(pd, HwPD, what, "pd")
        if implicit:
            raise PyverbsRDMAError(f"{what}: implicit (ODP) MRs are not supported", errno.EOPNOTSUPP)
        access = as_int(access, what, "access", U64, desc="not a set of access flags")
        length = as_int(length, what, "length", U64, desc="not a 64-bit length")
        if address is not None:
            address = as_int(address, what, "address", U64, desc="not a 64-bit address")
        if buffer is None:
            try:  # page-aligned, page-granular memory: safe with MADV_DONTFORK
                buffer = mmap.mmap(-1, max(length, 1))
            except (OSError, OverflowError, ValueError) as e:
                raise PyverbsRDMAError(f"{what}: cannot allocate {length} bytes ({e})",
                                       errno.ENOMEM) from None
            mv = memoryview(buffer)[:length]
        else:
            mv = _writable_view(buffer, what)
            if length and length != len(mv):
                if length > len(mv):
                    raise PyverbsRDMAError(f"{what}: length {length} exceeds the buffer's "
                                           f"{len(mv)} bytes", errno.EINVAL)
                mv = mv[:length]
        n = len(mv)
        # from_buffer exports the buffer (pinning the object) for as long as the array lives
        arr = (ctypes.c_char * max(n, 1)).from_buffer(mv if n else bytearray(1))
        ptr = addressof(arr)
        iova = ptr if address is None else address
        c = ffi.lib().ibv_reg_mr_iova2(pd._addr, ptr, n, iova, access)
        if not c:
            raise _null(what)
        self._addr = c
        self._c = ffi.ibv_mr.from_address(c)
        self._buffer, self._arr, self._mv = buffer, arr, mv
        self._ptr, self._iova, self._access = ptr, iova, access
        self.pd = pd
        _register(self, pd.context)
        self.context._mrs[self._c.lkey] = self
        self._use(pd)

    lkey = property(lambda self: self._c.lkey)
    rkey = property(lambda self: self._c.rkey)
    buf = property(lambda self: self._iova, doc="The iova: what SGEs and peers use.")
    addr = buf
    length = property(lambda self: self._c.length)
    access = property(lambda self: self._access)

    @property
    def mem(self) -> memoryview:
        """The registered bytes (the caller's buffer itself)."""
        return self._mv

    @property
    def host_addr(self) -> int:
        """The registered memory's real address in this process."""
        return self._ptr

    def rereg(self, flags: int, pd: Any = None, addr: Any = None, length: int = 0,
              access: int = 0) -> None:
        """``ibv_rereg_mr``: IBV_REREG_MR_CHANGE_PD (2), _ACCESS (4), _TRANSLATION (1, with
        ``addr`` a buffer object, registered at its real address)."""
        self._check()
        what = "Failed to re-register MR"
        flags = as_int(flags, what, "flags", 7)
        new_pd = pd if flags & 2 else self.pd
        if flags & 2:
            _hw_parent(pd, HwPD, what, "pd")
        access = as_int(access, what, "access", U64) if flags & 4 else self._access
        arr, ptr, mv, buffer, n = self._arr, self._ptr, self._mv, self._buffer, 0
        if flags & 1:
            buffer = addr if addr is not None else mmap.mmap(-1, max(1, length))
            mv = _writable_view(buffer, what)
            if length:
                mv = mv[:length]
            n = len(mv)
            arr = (ctypes.c_char * max(n, 1)).from_buffer(mv)
            ptr = addressof(arr)
        old_lkey = self._c.lkey
        rc = ffi.lib().ibv_rereg_mr(self._addr, flags, new_pd._addr if flags & 2 else None,
                                    ptr if flags & 1 else None, n, access)
        if rc:
            raise _fail(what, rc)
        self.context._mrs.pop(old_lkey, None)
        self.context._mrs[self._c.lkey] = self
        if flags & 1:
            self._arr, self._ptr, self._mv, self._buffer, self._iova = arr, ptr, mv, buffer, ptr
        if flags & 2:
            self._release(self.pd)
            self.pd = new_pd
            self._use(new_pd)
        self._access = access

    def close(self) -> None:
        Resource.close(self)  # EBUSY while used, then _destroy (the device decides the rest)

    def _destroy(self) -> None:
        if self.closed:
            return
        lkey = self._c.lkey
        rc = ffi.lib().ibv_dereg_mr(self._addr)
        if rc:
            raise _fail("Failed to dereg MR", rc)
        self.context._mrs.pop(lkey, None)
        self._release(self.pd)
        _unregister(self)
        # only now may the buffer move or go away
        self._arr = None
        try:
            self._mv.release()
        except BufferError:  # the program still exports it (a memoryview slice of its own)
            pass

    def __repr__(self) -> str:
        if self.closed:
            return "<MR closed>"
        return (f"<MR lkey=0x{self.lkey:x} rkey=0x{self.rkey:x} addr=0x{self.buf:x} "
                f"length={self.length} access=0x{self.access:x}>")


class HwMW(v_mr.MW):
    """``ibv_mw`` through ``context->ops.alloc_mw`` (a static inline in verbs.h)."""

    _hw_variant = staticmethod(dispatch.variant)

    def __init__(self, pd: Any, mw_type: int = ibv_mw_type.IBV_MW_TYPE_1) -> None:
        what = "Failed to allocate MW"
        _hw_parent(pd, HwPD, what, "pd")
        mw_type = as_int(mw_type, what, "mw_type", U32)
        op = pd.context._ops.alloc_mw
        if op is None:
            raise PyverbsRDMAError(f"{what}: the device has no memory windows", errno.EOPNOTSUPP)
        c = op(pd._addr, mw_type)
        if not c:
            raise _null(what)
        self._addr = c
        self._c = ffi.ibv_mw.from_address(c)
        self.pd = pd
        try:
            self.mw_type = ibv_mw_type(mw_type)
        except ValueError:
            self.mw_type = mw_type
        _register(self, pd.context)
        self._use(pd)

    @property
    def rkey(self) -> int:
        return self._c.rkey

    @property
    def handle(self) -> int:
        return self._c.handle

    def _destroy(self) -> None:
        if self.closed:
            return
        rc = self.context._ops.dealloc_mw(self._addr)
        if rc:
            raise _fail("Failed to dealloc MW", rc)
        self._release(self.pd)
        _unregister(self)

    def __repr__(self) -> str:
        return f"<MW type {int(self.mw_type)} rkey=0x{self.rkey:x}>"


# -- completion channel and CQ ---------------------------------------------------------------

class HwCompChannel(v_cq.CompChannel):
    """``ibv_comp_channel``; its ``fd`` (made non-blocking) works with select and asyncio."""

    _hw_variant = staticmethod(dispatch.variant)

    def __init__(self, context: Any) -> None:
        _hw_parent(context, HwContext, "Failed to create a completion channel", "context")
        c = ffi.lib().ibv_create_comp_channel(context._addr)
        if not c:
            raise _null("Failed to create a completion channel")
        self._addr = c
        self._c = ffi.ibv_comp_channel.from_address(c)
        fl = fcntl.fcntl(self._c.fd, fcntl.F_GETFL)
        fcntl.fcntl(self._c.fd, fcntl.F_SETFL, fl | os.O_NONBLOCK)  # EAGAIN, not a hang
        _register(self, context)

    @property
    def fd(self) -> int:
        return self._c.fd

    def wake(self) -> None:  # soft-device hook: nothing to wake here
        pass

    def _take(self) -> Any:
        """One pending event's CQ (its events counted), or None (EAGAIN)."""
        cq, ctxp = c_void_p(), c_void_p()
        if ffi.lib().ibv_get_cq_event(self._addr, byref(cq), byref(ctxp)):
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                return None
            raise _fail("Failed to get CQ event", err)
        ev_cq = self.context._objs.get(cq.value)
        if ev_cq is None:  # a CQ destroyed meanwhile cannot have events: ack and go on
            ffi.lib().ibv_ack_cq_events(cq.value, 1)
            return None
        ev_cq._events_unacked += 1
        ev_cq._hw_unacked += 1
        return ev_cq

    def get_cq_event(self, cq: Any = None, timeout: float | None = None) -> Any:
        """``ibv_get_cq_event``: the CQ of the next event. ``timeout`` seconds (None: block)
        raises ETIMEDOUT when it expires, as on the soft backend."""
        self._check()
        what = "Failed to get CQ event"
        deadline = None if timeout is None else time.monotonic() + timeout
        while (ev_cq := self._take()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise PyverbsRDMAError(f"{what}: timed out", errno.ETIMEDOUT)
            select.select([self._c.fd], [], [], left)
        if cq is not None and ev_cq is not cq:
            raise PyverbsRDMAError(f"{what}: the event is for another CQ", errno.EINVAL)
        return ev_cq

    async def wait_async(self) -> Any:
        """``await channel.wait_async()``: the next event's CQ, through the loop's reader."""
        self._check()
        loop = asyncio.get_running_loop()
        while (ev_cq := self._take()) is None:
            fut: asyncio.Future[None] = loop.create_future()
            loop.add_reader(self._c.fd, lambda: fut.done() or fut.set_result(None))
            try:
                await fut
            finally:
                loop.remove_reader(self._c.fd)
        return ev_cq

    def _destroy(self) -> None:
        if self.closed:
            return
        rc = ffi.lib().ibv_destroy_comp_channel(self._addr)
        if rc:
            raise _fail("Failed to destroy completion channel", rc)
        _unregister(self)


_BATCH = 16


class HwCQ(v_cq.CQ):
    """``ibv_cq``. ``poll`` goes through ``context->ops.poll_cq`` into a preallocated
    ``ibv_wc`` array and returns :class:`softrdma.completion.WC` objects, as the soft CQ."""

    _hw_variant = staticmethod(dispatch.variant)

    def __init__(self, context: Any, cqe: int, cq_context: Any = None,
                 channel: Any = None, comp_vector: int = 0) -> None:
        what = "Failed to create CQ"
        _hw_parent(context, HwContext, what, "context")
        cqe = as_int(cqe, what, "cqe", (1 << 31) - 1)
        comp_vector = as_int(comp_vector, what, "comp_vector", (1 << 31) - 1)
        if channel is not None:
            _hw_parent(channel, HwCompChannel, what, "channel")
        c = ffi.lib().ibv_create_cq(context._addr, cqe, None,
                                    channel._addr if channel is not None else None, comp_vector)
        if not c:
            raise _null(what)
        self._addr = c
        self._c = ffi.ibv_cq.from_address(c)
        self.cq_context = cq_context
        self.channel = channel
        self._wcs: deque[WC] = deque()  # polled from the device, not yet handed out
        self._arr = (ffi.ibv_wc * _BATCH)()
        self._arr_addr = addressof(self._arr)
        self._poll_cq = context._ops.poll_cq
        self._events_unacked = 0  # what the program has not acked (the soft meaning)
        self._hw_unacked = 0  # what libibverbs has not been told (acked at destroy)
        self.error = False
        _register(self, context)
        context._objs[c] = self
        self._use(channel)

    @property
    def cqe(self) -> int:
        return self._c.cqe

    @cqe.setter
    def cqe(self, v: int) -> None:  # the soft CQ sets it; here the device decides
        pass

    def _fill(self, want: int) -> None:
        """Move up to ``want`` completions from the device into ``self._wcs``."""
        arr, q = self._arr, self._wcs
        while want > 0:
            n = self._poll_cq(self._addr, min(want, _BATCH), self._arr_addr)
            if n < 0:
                raise _fail("Failed to poll CQ", -n)
            for i in range(n):
                c = arr[i]
                flags = c.wc_flags
                imm = socket.ntohl(c.imm_data) if flags & _WC_IMM else \
                    c.imm_data if flags & _WC_INV else 0
                wc = WC(c.wr_id, c.status, c.opcode, c.vendor_err, c.byte_len, c.qp_num,
                        c.src_qp, imm, flags, c.pkey_index, c.slid, c.sl, c.dlid_path_bits)
                if flags & _WC_INV:
                    wc.invalidated_rkey = c.imm_data
                q.append(wc)
            if n < min(want, _BATCH):
                return
            want -= n

    def poll(self, num_entries: int = 1) -> tuple[int, list[WC]]:
        self._check()
        q = self._wcs
        if len(q) < num_entries:
            self._fill(num_entries - len(q))
        out = [q.popleft() for _ in range(min(num_entries, len(q)))]
        return len(out), out

    def poll_all(self) -> list[WC]:
        self._check()
        self._fill(1 << 30)
        out = list(self._wcs)
        self._wcs.clear()
        return out

    def __len__(self) -> int:
        """Completions ready now (polled from the device and kept for the next poll)."""
        if not self.closed:
            self._fill(1 << 30)
        return len(self._wcs)

    def req_notify(self, solicited_only: bool = False) -> None:
        self._check()
        rc = self.context._ops.req_notify_cq(self._addr, 1 if solicited_only else 0)
        if rc:
            raise _fail("Failed to request notification", rc)

    def ack_events(self, num_events: int) -> None:
        num_events = as_int(num_events, "Failed to ack CQ events", "num_events", U32)
        if num_events > self._events_unacked:
            raise PyverbsRDMAError(f"Failed to ack {num_events} CQ events: only "
                                   f"{self._events_unacked} unacknowledged", errno.EINVAL)
        self._events_unacked -= num_events
        n = min(num_events, self._hw_unacked)
        if n:
            ffi.lib().ibv_ack_cq_events(self._addr, n)
            self._hw_unacked -= n

    def resize(self, cqe: int) -> None:
        self._check()
        cqe = as_int(cqe, "Failed to resize CQ", "cqe", (1 << 31) - 1)
        rc = ffi.lib().ibv_resize_cq(self._addr, cqe)
        if rc:
            raise _fail(f"Failed to resize CQ to {cqe}", rc)

    def push(self, wc: WC, solicited: bool = False) -> bool:  # soft engines only
        raise PyverbsRDMAError("push: completions come from the device", errno.EOPNOTSUPP)

    def _destroy(self) -> None:
        if self.closed:
            return
        if self._hw_unacked:  # ibv_destroy_cq waits for every event to be acked
            ffi.lib().ibv_ack_cq_events(self._addr, self._hw_unacked)
            self._hw_unacked = 0
        rc = ffi.lib().ibv_destroy_cq(self._addr)
        if rc:
            raise _fail("Failed to destroy CQ", rc)
        self.context._objs.pop(self._addr, None)
        self._release(self.channel)
        _unregister(self)

    def __repr__(self) -> str:
        return f"<CQ cqe={self.cqe} (libibverbs)>" if not self.closed else "<CQ closed>"


# -- work requests ---------------------------------------------------------------------------

def _recv_chain(wrs: list[Any], max_sge: int, what: str) -> tuple[Any, list[Any]]:
    """C ``ibv_recv_wr`` array (linked) for checked RecvWRs, and what keeps it alive."""
    arr = (ffi.ibv_recv_wr * len(wrs))()
    keep: list[Any] = [arr]
    base = addressof(arr)
    size = sizeof(ffi.ibv_recv_wr)
    for i, w in enumerate(wrs):
        f = f"wr[{i}]"
        try:
            require(w, RecvWR, what, f)
            wr_id = as_int(w.wr_id, what, f"{f}.wr_id", U64)
            sges, _ = sge_list(w, max_sge, what, f)
        except PyverbsRDMAError as e:
            e.index = i  # type: ignore[attr-defined]
            raise
        c = arr[i]
        c.wr_id = wr_id
        if sges:
            sg = (ffi.ibv_sge * len(sges))(*sges)
            keep.append(sg)
            c.sg_list = ctypes.cast(sg, ctypes.POINTER(ffi.ibv_sge))
        c.num_sge = len(sges)
        if i + 1 < len(wrs):
            c.next = ctypes.cast(base + (i + 1) * size, ctypes.POINTER(ffi.ibv_recv_wr))
    return arr, keep


def _post(fn: Any, obj_addr: int, arr: Any, size: int, wrs: list[Any], bad_wr: Any,
          what: str) -> None:
    """Call a post verb and turn its result into softrdma's error (``bad_wr_index``)."""
    bad = c_void_p()
    rc = fn(obj_addr, addressof(arr), addressof(bad))
    if rc:
        # rxe may leave bad NULL (and still queue the WR): report the first WR then
        i = (bad.value - addressof(arr)) // size if bad.value else 0
        e = _fail(what, rc)
        mark_bad(e, wrs[i], i, bad_wr)
        raise e


def _posted_list(wr: Any, bad_wr: Any, cls: type, what: str) -> list[Any]:
    check_wr_arg(wr, bad_wr, cls, what)
    return list(wr_chain(wr))


def _raise_at(e: PyverbsRDMAError, wrs: list[Any], bad_wr: Any, post: Any) -> None:
    """WR ``e.index`` was refused before reaching the device: post the WRs before it (as
    the soft backend and ibv_post_send leave them posted), then raise naming it."""
    i = getattr(e, "index", 0)
    if i:
        post(wrs[:i])
    mark_bad(e, wrs[i], i, bad_wr)
    raise e


# -- SRQ -------------------------------------------------------------------------------------

class HwSRQ(v_srq.SRQ):
    _hw_variant = staticmethod(dispatch.variant)

    def __init__(self, pd: Any, init_attr: SrqInitAttr) -> None:
        what = "Failed to create SRQ"
        _hw_parent(pd, HwPD, what, "pd")
        require(init_attr, SrqInitAttr, what, "init_attr")
        a = require(init_attr.attr, SrqAttr, what, "init_attr.attr")
        c = ffi.ibv_srq_init_attr()
        for n in ("max_wr", "max_sge", "srq_limit"):
            setattr(c.attr, n, as_int(getattr(a, n), what, f"init_attr.attr.{n}", U32))
        s = ffi.lib().ibv_create_srq(pd._addr, byref(c))
        if not s:
            raise _null(what)
        self._addr = s
        self.pd = pd
        self.srq_context = init_attr.srq_context
        self.max_wr, self.max_sge, self.srq_limit = c.attr.max_wr, c.attr.max_sge, c.attr.srq_limit
        self.error = False
        _register(self, pd.context)
        self.context._objs[s] = self
        self._post_srq_recv = self.context._ops.post_srq_recv
        self._use(pd)

    def post_recv(self, wr: Any, bad_wr: Any = None) -> None:
        self._check()
        what = "Failed to post receive to SRQ"
        wrs = _posted_list(wr, bad_wr, RecvWR, what)
        try:
            arr, keep = _recv_chain(wrs, self.max_sge, what)
        except PyverbsRDMAError as e:
            _raise_at(e, wrs, bad_wr, self.post_recv)
        _post(self._post_srq_recv, self._addr, arr, sizeof(ffi.ibv_recv_wr), wrs, bad_wr, what)

    def modify(self, attr: SrqAttr, attr_mask: int) -> None:
        self._check()
        what = "Failed to modify SRQ"
        require(attr, SrqAttr, what, "attr")
        mask = as_int(attr_mask, what, "attr_mask", (1 << 31) - 1)
        c = ffi.ibv_srq_attr(as_int(attr.max_wr, what, "attr.max_wr", U32),
                             as_int(attr.max_sge, what, "attr.max_sge", U32),
                             as_int(attr.srq_limit, what, "attr.srq_limit", U32))
        rc = ffi.lib().ibv_modify_srq(self._addr, byref(c), mask)
        if rc:
            raise _fail(what, rc)
        q = self.query()
        self.max_wr, self.srq_limit = q.max_wr, q.srq_limit

    def query(self) -> SrqAttr:
        self._check()
        c = ffi.ibv_srq_attr()
        rc = ffi.lib().ibv_query_srq(self._addr, byref(c))
        if rc:
            raise _fail("Failed to query SRQ", rc)
        return SrqAttr(max_wr=c.max_wr, max_sge=c.max_sge, srq_limit=c.srq_limit)

    def take(self) -> Any:  # soft engines only
        return None

    def _destroy(self) -> None:
        if self.closed:
            return
        rc = ffi.lib().ibv_destroy_srq(self._addr)
        if rc:
            raise _fail("Failed to destroy SRQ", rc)
        self.context._objs.pop(self._addr, None)
        self._release(self.pd)
        _unregister(self)


# -- AH --------------------------------------------------------------------------------------

class HwAH(v_ah.AH):
    _hw_variant = staticmethod(dispatch.variant)

    def __init__(self, pd: Any, attr: Any = None) -> None:
        what = "Failed to create AH"
        _hw_parent(pd, HwPD, what, "pd")
        if attr is None:
            raise PyverbsRDMAError(f"{what}: attr (AHAttr) is required", errno.EINVAL)
        c = ffi.ibv_ah_attr()
        convert.ah_attr_to_c(attr, c, what, "attr")
        a = ffi.lib().ibv_create_ah(pd._addr, byref(c))
        if not a:
            raise _null(what)
        self._addr = a
        self.pd = pd
        self.attr = attr
        self.av = None
        _register(self, pd.context)
        self._use(pd)

    def _destroy(self) -> None:
        if self.closed:
            return
        rc = ffi.lib().ibv_destroy_ah(self._addr)
        if rc:
            raise _fail("Failed to destroy AH", rc)
        self._release(self.pd)
        _unregister(self)


# -- QP --------------------------------------------------------------------------------------

_SEND_WR_SIZE = sizeof(ffi.ibv_send_wr)


class HwQP(v_qp.QP):
    """``ibv_qp``: create, modify, query and destroy through the exported verbs; posting
    through ``context->ops.post_send``/``post_recv``."""

    _hw_variant = staticmethod(dispatch.variant)

    def __init__(self, pd_or_ctx: Any, init_attr: QPInitAttr, qp_attr: QPAttr | None = None) -> None:
        what = "Failed to create QP"
        pd = _hw_parent(pd_or_ctx, HwPD, what, "pd")
        require(init_attr, QPInitAttr, what, "init_attr")
        require(qp_attr, QPAttr, what, "qp_attr", optional=True)
        qpt = as_int(init_attr.qp_type, what, "init_attr.qp_type", U32)
        scq, rcq, srq = init_attr.scq, init_attr.rcq, init_attr.srq
        if scq is None or rcq is None:
            raise PyverbsRDMAError(f"{what}: both a send CQ (init_attr.scq) and a receive CQ "
                                   f"(init_attr.rcq) are required", errno.EINVAL)
        _hw_parent(scq, HwCQ, what, "init_attr.scq")
        _hw_parent(rcq, HwCQ, what, "init_attr.rcq")
        if srq is not None:
            _hw_parent(srq, HwSRQ, what, "init_attr.srq")
        c = ffi.ibv_qp_init_attr()
        c.send_cq = ctypes.cast(scq._addr, ctypes.POINTER(ffi.ibv_cq))
        c.recv_cq = ctypes.cast(rcq._addr, ctypes.POINTER(ffi.ibv_cq))
        if srq is not None:
            c.srq = ctypes.cast(srq._addr, ctypes.POINTER(ffi.ibv_srq))
        convert.cap_to_c(init_attr.cap, c.cap, what, "init_attr.cap")
        c.qp_type = qpt
        c.sq_sig_all = 1 if init_attr.sq_sig_all else 0
        q = ffi.lib().ibv_create_qp(pd._addr, byref(c))
        if not q:
            raise _null(what)
        self._addr = q
        self._c = ffi.ibv_qp.from_address(q)
        self.qp_num = self._c.qp_num
        self.pd = pd
        try:
            self.qp_type = T(qpt)
        except ValueError:
            self.qp_type = qpt
        self.qp_context = init_attr.qp_context
        self.send_cq, self.recv_cq, self.srq = scq, rcq, srq
        self.sq_sig_all = bool(init_attr.sq_sig_all)
        self.cap = convert.cap_from_c(c.cap)  # what the device granted
        init_attr.cap = convert.cap_from_c(c.cap)
        _register(self, pd.context)
        self.context._objs[q] = self
        ops = self.context._ops
        self._post_send, self._post_recv = ops.post_send, ops.post_recv
        self._mrs = self.context._mrs
        self._use(pd, scq, rcq, srq)
        if qp_attr is not None:
            self.to_rts(qp_attr) if self.qp_type == T.IBV_QPT_UD else self.to_init(qp_attr)

    # -- state ------------------------------------------------------------------------------
    def _query_c(self, mask: int) -> tuple[ffi.ibv_qp_attr, ffi.ibv_qp_init_attr]:
        self._check()
        a, ia = ffi.ibv_qp_attr(), ffi.ibv_qp_init_attr()
        rc = ffi.lib().ibv_query_qp(self._addr, byref(a), mask, byref(ia))
        if rc:
            raise _fail("Failed to query QP", rc)
        return a, ia

    @property
    def state(self) -> int:
        """The QP's state as the device reports it (``ibv_query_qp``: an error the device
        detected shows as IBV_QPS_ERR)."""
        return self._query_c(int(M.IBV_QP_STATE))[0].qp_state

    qp_state = state

    @property
    def attr(self) -> QPAttr:
        return self.query()[0]

    @property
    def sq_draining(self) -> bool:
        return bool(self._query_c(int(M.IBV_QP_STATE))[0].sq_draining)

    def modify(self, attr: QPAttr, attr_mask: int) -> None:
        """``ibv_modify_qp``; the device checks the transition and values (EINVAL...)."""
        self._check()
        what = "Failed to modify QP"
        mask = as_int(attr_mask, what, "attr_mask", (1 << 31) - 1, desc="not an attribute mask")
        c = convert.qp_attr_to_c(attr, mask, what)
        rc = ffi.lib().ibv_modify_qp(self._addr, byref(c), mask)
        if rc:
            raise _fail(what, rc)

    def query(self, attr_mask: int = 0) -> tuple[QPAttr, QPInitAttr]:
        a, ia = self._query_c(as_int(attr_mask, "Failed to query QP", "attr_mask",
                                     (1 << 31) - 1) or _ALL_QP_ATTRS)
        attr = convert.qp_attr_from_c(a)
        init = QPInitAttr(qp_type=self.qp_type, qp_context=self.qp_context, scq=self.send_cq,
                          rcq=self.recv_cq, srq=self.srq, cap=convert.cap_from_c(ia.cap),
                          sq_sig_all=ia.sq_sig_all)
        return attr, init

    def to_error(self) -> None:
        self.modify(QPAttr(qp_state=6), int(M.IBV_QP_STATE))  # IBV_QPS_ERR

    def flush(self) -> None:  # the device flushes by itself
        pass

    # -- posting ----------------------------------------------------------------------------
    def post_recv(self, wr: Any, bad_wr: Any = None) -> None:
        self._check()
        what = "Failed to post receive"
        wrs = _posted_list(wr, bad_wr, RecvWR, what)
        try:
            arr, keep = _recv_chain(wrs, max(self.cap.max_recv_sge, 1 << 16), what)
        except PyverbsRDMAError as e:
            _raise_at(e, wrs, bad_wr, self.post_recv)
        _post(self._post_recv, self._addr, arr, sizeof(ffi.ibv_recv_wr), wrs, bad_wr, what)

    def post_send(self, wr: Any, bad_wr: Any = None) -> None:
        """``ibv_post_send`` of a WR, a chain or a list, every opcode the device has. The
        C WRs live for the call only (providers copy them); the data must stay until the
        completion. On failure ``bad_wr``/``bad_wr_index`` name the first WR not posted."""
        self._check()
        what = "Failed to post send"
        wrs = _posted_list(wr, bad_wr, SendWR, what)
        try:
            arr, keep = self._send_chain(wrs, what)
        except PyverbsRDMAError as e:
            _raise_at(e, wrs, bad_wr, self.post_send)
        _post(self._post_send, self._addr, arr, _SEND_WR_SIZE, wrs, bad_wr, what)
        for w in wrs:  # a type 2 window's new rkey, as the soft MW shows it after a bind
            if w.opcode == _BIND and getattr(w.mw, "mw_type", 1) == 2:
                w.mw._c.rkey = w.bind_rkey

    def _send_chain(self, wrs: list[Any], what: str) -> tuple[Any, list[Any]]:
        arr = (ffi.ibv_send_wr * len(wrs))()
        keep: list[Any] = [arr]
        base = addressof(arr)
        ud = self.qp_type == T.IBV_QPT_UD
        for i, w in enumerate(wrs):
            try:
                self._fill_send(arr[i], w, f"wr[{i}]", what, keep, ud)
            except PyverbsRDMAError as e:
                e.index = i  # type: ignore[attr-defined]
                raise
            if i + 1 < len(wrs):
                arr[i].next = ctypes.cast(base + (i + 1) * _SEND_WR_SIZE,
                                          ctypes.POINTER(ffi.ibv_send_wr))
        return arr, keep

    def _fill_send(self, c: Any, w: Any, f: str, what: str, keep: list[Any], ud: bool) -> None:
        require(w, SendWR, what, f)
        scalars = (w.opcode, w.send_flags, w.wr_id, w.imm_data, w.remote_addr, w.rkey,
                   w.compare_add, w.swap)
        if all(type(v) is int for v in scalars) and 0 <= w.opcode <= U32 and \
                0 <= w.send_flags <= _SEND_FLAGS and 0 <= w.wr_id <= U64 and \
                0 <= w.imm_data <= U32 and 0 <= w.remote_addr <= U64 and 0 <= w.rkey <= U32 \
                and 0 <= w.compare_add <= U64 and 0 <= w.swap <= U64:
            opcode, flags, wr_id, imm, raddr, rkey, cadd, swap = scalars
        else:  # the named checks of the soft QP: the same messages
            opcode, flags, wr_id, imm, raddr, rkey, cadd, swap = \
                self._check_send_scalars(w, what, f)
        sges, _ = sge_list(w, 1 << 16, what, f)
        if sges and flags & _INLINE:
            sges = [self._host_sge(s) for s in sges]
        c.wr_id, c.opcode, c.send_flags = wr_id, opcode, flags
        if sges:
            sg = (ffi.ibv_sge * len(sges))(*sges)
            keep.append(sg)
            c.sg_list = ctypes.cast(sg, ctypes.POINTER(ffi.ibv_sge))
        c.num_sge = len(sges)
        # immediate data: a host integer, __be32 in C; an rkey to invalidate: host order
        c.imm_data = socket.htonl(imm) if opcode in _IMM_OPS else imm
        if opcode in _RDMA_OPS:
            c.wr.rdma.remote_addr, c.wr.rdma.rkey = raddr, rkey
        elif opcode in _ATOMIC_OPS:
            a = c.wr.atomic
            a.remote_addr, a.compare_add, a.swap, a.rkey = raddr, cadd, swap, rkey
        elif opcode == _BIND:
            self._fill_bind(c, w, f, what)
        if ud:
            if w.ah is None or getattr(w.ah, "closed", True):
                raise PyverbsRDMAError(f"{what}: a UD send needs an address handle "
                                       f"({f}.ah, set by set_wr_ud)", errno.EINVAL)
            require(w.ah, HwAH, what, f"{f}.ah")
            c.wr.ud.ah = ctypes.cast(w.ah._addr, ctypes.POINTER(ffi.ibv_ah))
            c.wr.ud.remote_qpn = as_int(w.remote_qpn, what, f"{f}.remote_qpn", U24,
                                        desc="not a 24-bit QP number")
            c.wr.ud.remote_qkey = as_int(w.remote_qkey, what, f"{f}.remote_qkey", U32)

    def _fill_bind(self, c: Any, w: Any, f: str, what: str) -> None:
        if w.mw is None or w.bind_info is None:
            raise PyverbsRDMAError(f"{what}: {f}.opcode IBV_WR_BIND_MW needs "
                                   f"set_bind_wr(mw, bind_info) ({f}.mw, {f}.bind_info)",
                                   errno.EINVAL)
        require(w.mw, HwMW, what, f"{f}.mw")
        info = require(w.bind_info, MWBindInfo, what, f"{f}.bind_info")
        b = c.bind_mw
        b.mw = ctypes.cast(w.mw._addr, ctypes.POINTER(ffi.ibv_mw))
        b.rkey = as_int(w.bind_rkey, what, f"{f}.bind_rkey", U32, desc="not a 32-bit key")
        self._fill_bind_info(b.bind_info, info, what, f"{f}.bind_info")

    @staticmethod
    def _fill_bind_info(b: Any, info: Any, what: str, f: str) -> None:
        if info.mr is not None:
            require(info.mr, HwMR, what, f"{f}.mr")
            b.mr = ctypes.cast(info.mr._addr, ctypes.POINTER(ffi.ibv_mr))
        b.addr = as_int(info.addr, what, f"{f}.addr", U64, desc="not a 64-bit address")
        b.length = as_int(info.length, what, f"{f}.length", U64, desc="not a 64-bit length")
        b.mw_access_flags = as_int(info.mw_access_flags, what, f"{f}.mw_access_flags", U32)

    def _host_sge(self, sge: tuple[int, int, int]) -> tuple[int, int, int]:
        """An inline SGE's iova as the real address the provider will copy from."""
        addr, length, lkey = sge
        mr = self._mrs.get(lkey)
        if mr is not None and mr._iova <= addr and addr + length <= mr._iova + len(mr._mv):
            return addr - mr._iova + mr._ptr, length, lkey
        return sge

    def bind_mw(self, mw: Any, mw_bind: Any) -> None:
        """``ibv_bind_mw`` (type 1): the inline's checks, then ``context->ops.bind_mw``;
        ``mw.rkey`` is the new rkey (the provider updates it)."""
        self._check()
        what = "Failed to bind MW"
        _hw_parent(mw, HwMW, what, "mw")
        require(mw_bind, v_mr.MWBind, what, "mw_bind")
        info = require(mw_bind.bind_info, MWBindInfo, what, "mw_bind.bind_info")
        if mw.mw_type != 1:
            raise PyverbsRDMAError(f"{what}: use an IBV_WR_BIND_MW work request for type 2 "
                                   f"windows", errno.EINVAL)
        if info.mr is None and (info.addr or info.length):
            raise PyverbsRDMAError(f"{what}: bind_info has an address range but no MR",
                                   errno.EINVAL)
        if info.mr is not None and getattr(info.mr, "pd", None) is not mw.pd:
            raise PyverbsRDMAError(f"{what}: the MR and the MW are in different PDs", errno.EPERM)
        b = ffi.ibv_mw_bind()
        b.wr_id = as_int(mw_bind.wr_id, what, "mw_bind.wr_id", U64)
        b.send_flags = as_int(mw_bind.send_flags, what, "mw_bind.send_flags", _SEND_FLAGS)
        self._fill_bind_info(b.bind_info, info, what, "mw_bind.bind_info")
        rc = self.context._ops.bind_mw(self._addr, mw._addr, addressof(b))
        if rc:
            raise _fail(what, rc)

    def _destroy(self) -> None:
        if self.closed:
            return
        rc = ffi.lib().ibv_destroy_qp(self._addr)
        if rc:
            raise _fail("Failed to destroy QP", rc)
        self.context._objs.pop(self._addr, None)
        self._release(self.pd, self.send_cq, self.recv_cq, self.srq)
        _unregister(self)

    def __repr__(self) -> str:
        if self.closed:
            return "<QP closed>"
        name = self.qp_type.name.removeprefix("IBV_QPT_") if isinstance(self.qp_type, T) \
            else self.qp_type
        return f"<QP {name} 0x{self.qp_num:x} (libibverbs)>"


def _all() -> Iterable[tuple[type, type]]:
    return ((v_device.Context, HwContext), (v_pd.PD, HwPD), (v_mr.MR, HwMR), (v_mr.MW, HwMW),
            (v_cq.CQ, HwCQ), (v_cq.CompChannel, HwCompChannel), (v_srq.SRQ, HwSRQ),
            (v_ah.AH, HwAH), (v_qp.QP, HwQP))


dispatch.install(_all())
