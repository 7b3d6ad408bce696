"""rdma_cm on a real RDMA device through librdmacm: :class:`CMEventChannel`,
:class:`CMEvent` and :class:`CMID` with the API of :mod:`softrdma.rdmacm.cmid`.

``softrdma.rdmacm.CMEventChannel()`` returns this module's channel when the hardware
backend is chosen (docs/backends.md, "rdma_cm"); every event read from it and every id
made on it are this module's too. Errors are the soft backend's: PyverbsRDMAError with the
errno librdmacm sets.

The id's QP is made with the verbs backend (``verbs_api.QP`` on the PD of the context
librdmacm opened, ``id->verbs``) and is never given to librdmacm (``id->qp`` stays NULL).
So librdmacm leaves the QP's transitions to us, and this module makes them where
librdmacm's ``rdma_create_qp`` users get them (cma.c): INIT when the QP is attached,
INIT/RTR/RTS with ``rdma_init_qp_attr`` before ``rdma_accept`` and on a
CONNECT_RESPONSE (then ``rdma_establish``, and the event is reported as ESTABLISHED, as
``ucma_process_conn_resp`` does), ERR before ``rdma_disconnect``. Why not
``rdma_create_qp``: its QP would be librdmacm's ``ibv_qp``, not a verbs_api QP with the
backend's posting, completion and lifetime rules; this way the socket layer's QP is the
same kind of object on both backends.

Every event is copied out and acknowledged at once (``rdma_destroy_id`` and
``rdma_migrate_id`` wait for unacknowledged events), so a :class:`CMEvent` holds no
librdmacm resource.

Modules: :mod:`.cma_ffi` (rdma_cma.h in ctypes, its layout check), :mod:`.cma_id` (the C
id, its addresses and QP transitions), :mod:`.cma_event` (channel and events), this one
(the CMID API), :mod:`.cma_select` (which backend).
"""

from __future__ import annotations

import ctypes
import errno
import sys
import time
from ctypes import byref, c_int, c_uint8, c_void_p, sizeof
from typing import Any

from ..readiness import readable
from ..errors import PyverbsRDMAError
from ..rdmacm.cmid import CMIDBase
from ..rdmacm.enums import (
    RAI_PASSIVE, RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR, RDMA_PS_IB, RDMA_PS_TCP,
    RDMA_PS_UDP, rdma_cm_event_type as E,
)
from . import cma_ffi as F, convert
from .cma_event import CMEvent, CMEventChannel, Event
from .cma_id import RdmaCmId, context_of, sockaddr as _sockaddr

__all__ = ["CMEventChannel", "CMEvent", "CMID", "RdmaCmId", "Event"]

# ---- the id -----------------------------------------------------------------------------------


class CMID(CMIDBase):
    """``rdma_cm_id`` on librdmacm, made as the soft one: ``CMID(channel, port_space=...)``
    (events), ``CMID(AddrInfo(...), qp_init_attr, pd)`` (synchronous), ``CMID(event,
    listen_id=listener)`` (the id a CONNECT_REQUEST carries). What does not depend on the
    backend (the rdma_verbs.h helpers, ``create_qp``, ``close``...) is
    :class:`softrdma.rdmacm.cmid.CMIDBase`'s."""

    _channel_class = CMEventChannel
    _event_class = CMEvent

    def _create_id(self, channel: CMEventChannel, port_space: int) -> RdmaCmId:
        if port_space not in (RDMA_PS_TCP, RDMA_PS_UDP, RDMA_PS_IB):
            raise PyverbsRDMAError(f"Failed to create CM ID: port_space {port_space!r:.40} "
                                   f"is not RDMA_PS_TCP, _UDP or _IB", errno.EINVAL)
        p = c_void_p()
        F.call("Failed to create CM ID", "rdma_create_id", channel.handle, byref(p), None,
               int(port_space))
        return RdmaCmId(p.value, channel)

    def _take_event_id(self, event: CMEvent, listen_id: CMIDBase) -> None:
        self.id = event.id

    def _take_request(self, to_conn: CMIDBase, event: Event) -> None:
        to_conn.id = event.id
        to_conn._sync_channel = CMEventChannel()
        to_conn.event_channel = to_conn._sync_channel
        event.id.migrate(to_conn._sync_channel)

    def _has_device(self, cid: RdmaCmId) -> bool:
        return self.context is not None

    def _set_id_option(self, cid: RdmaCmId, optname: int, value: int) -> None:
        v: Any = c_int(value) if optname == RDMA_OPTION_ID_REUSEADDR else c_uint8(value)
        F.call("Failed to Set Option", "rdma_set_option", cid.addr, RDMA_OPTION_ID, optname,
               byref(v), sizeof(v))

    def _init_qp_attr(self, qp_state: int) -> tuple[Any, int]:
        a, mask = self._check().init_qp_attr(qp_state)
        return convert.qp_attr_from_c(a), mask

    # ---- synchronous plumbing -----------------------------------------------------------
    def _create_ep(self, ai: Any, qp_init_attr: Any) -> None:
        """``rdma_create_ep``: an id with a channel of its own, bound (passive) or resolved
        (active), with a QP if ``qp_init_attr`` is given (active side)."""
        self.sync = True
        self._sync_channel = CMEventChannel()
        self.event_channel = self._sync_channel
        try:
            self.id = self._create_id(self._sync_channel, ai.port_space)
            if ai.flags & RAI_PASSIVE:
                self.bind_addr(ai)
                return
            self.resolve_addr(ai)
            self.resolve_route()
            if qp_init_attr is not None:
                self.create_qp(qp_init_attr)
        except BaseException:
            self.close()
            raise

    # ---- properties ---------------------------------------------------------------------
    @property
    def context(self) -> Any:
        """The verbs_api Context of the device the id is bound to (None before)."""
        if self.ctx is None and self.id is not None and self.id.verbs:
            self.ctx = context_of(self.id.verbs)
        return self.ctx

    @property
    def dev_name(self) -> str:
        ctx = self.context
        return ctx.name if ctx is not None else ""

    @property
    def port_num(self) -> int:
        return self.id.c.port_num if self.id is not None else 1

    @property
    def local_addr(self) -> tuple[str, int]:
        """``(ip, port)`` the id is bound to (``rdma_get_local_addr``)."""
        rid = self._check()
        ip = rid.local_ip
        return (str(ip) if ip is not None else "0.0.0.0", rid.src_port)

    @property
    def peer_addr(self) -> tuple[str, int]:
        """``(ip, port)`` of the peer (``rdma_get_peer_addr``)."""
        rid = self._check()
        ip = rid.dst_ip
        return (str(ip) if ip is not None else "0.0.0.0", rid.dst_port)

    @property
    def path_ack_timeout(self) -> int:
        """The connection's local ACK timeout exponent as the CM REQ carries it: the path
        record's packet lifetime + 1 (cm.c; the passive side's path is built from the
        REQ); 0 while there is no path."""
        plt = self._check().packet_life_time
        return 0 if plt is None else min(plt + 1, 31)

    # ---- addressing and connecting ------------------------------------------------------
    def bind_addr(self, lai: Any) -> None:
        sa = _sockaddr(lai.src, lai.src_port)
        F.call("Failed to Bind Address", "rdma_bind_addr", self._check().addr, byref(sa))
        self._after_bind()

    def resolve_addr(self, rai: Any, timeout_ms: int = 2000) -> None:
        rid = self._check()
        src = _sockaddr(rai.src, rai.src_port) if rai.src is not None else None
        dst = _sockaddr(rai.dst, rai.dst_port)
        F.call("Failed to Resolve Address", "rdma_resolve_addr", rid.addr,
               byref(src) if src is not None else None, byref(dst), int(timeout_ms))
        if self.sync:
            self._wait(E.RDMA_CM_EVENT_ADDR_RESOLVED, "Failed to Resolve Address")

    def resolve_route(self, timeout_ms: int = 2000) -> None:
        F.call("Failed to Resolve Route", "rdma_resolve_route", self._check().addr,
               int(timeout_ms))
        if self.sync:
            self._wait(E.RDMA_CM_EVENT_ROUTE_RESOLVED, "Failed to Resolve Route")
        self._after_bind()

    def listen(self, backlog: int = 0) -> None:
        F.call("Failed to Listen", "rdma_listen", self._check().addr, int(backlog))
        self._after_bind()

    def migrate(self, channel: CMEventChannel) -> None:
        """``rdma_migrate_id``: the id's events go to ``channel`` from now on."""
        self._check().migrate(channel)
        self.event_channel = channel

    def _conn_param(self, param: Any) -> tuple[F.rdma_conn_param, Any]:
        from ..rdmacm.cmid import ConnParam
        p = (param if param is not None else ConnParam()).params
        c = F.rdma_conn_param(responder_resources=p.responder_resources,
                              initiator_depth=p.initiator_depth, flow_control=p.flow_control,
                              retry_count=p.retry_count, rnr_retry_count=p.rnr_retry_count,
                              srq=p.srq, qp_num=p.qp_num)
        qp = self.qp
        if qp is not None:  # as librdmacm does for a QP it knows
            c.qp_num, c.srq = qp.qp_num, 1 if qp.srq is not None else 0
        buf = None
        if p.private_data:
            buf = ctypes.create_string_buffer(bytes(p.private_data), len(p.private_data))
            c.private_data, c.private_data_len = ctypes.addressof(buf), len(p.private_data)
        return c, buf  # buf: kept alive by the caller until the call returns

    def connect(self, param: Any = None) -> None:
        rid = self._check()
        c, _buf = self._conn_param(param)
        F.call("Failed to Connect", "rdma_connect", rid.addr, byref(c))
        if self.sync:
            self._wait(E.RDMA_CM_EVENT_ESTABLISHED, "Failed to Connect")

    def accept(self, param: Any = None) -> None:
        rid = self._check()
        c, _buf = self._conn_param(param)
        if rid.qp is not None and not rid.is_ud:
            try:
                rid.to_rts(c.responder_resources, c.initiator_depth)
            except PyverbsRDMAError:
                rid.qp.to_error()
                raise
        F.call("Failed to Accept Connection", "rdma_accept", rid.addr, byref(c))
        if self.sync and not rid.is_ud:
            self._wait(E.RDMA_CM_EVENT_ESTABLISHED, "Failed to Accept Connection")

    def establish(self) -> None:
        F.call("Failed to Establish", "rdma_establish", self._check().addr)

    def reject(self, private_data: bytes | None = None) -> None:
        data = bytes(private_data or b"")
        buf = ctypes.create_string_buffer(data, len(data)) if data else None
        F.call("Failed to Reject", "rdma_reject", self._check().addr, buf, len(data))

    def disconnect(self) -> None:
        rid = self._check()
        if rid.qp is not None:  # as librdmacm's ucma_modify_qp_err for an IB transport
            try:
                rid.qp.to_error()
            except PyverbsRDMAError:
                pass
        F.call("Failed to Disconnect", "rdma_disconnect", rid.addr)
        if self.sync:
            try:
                self._wait(E.RDMA_CM_EVENT_DISCONNECTED, "Failed to Disconnect", 10.0)
            except PyverbsRDMAError:
                pass

    def _get_comp(self, cq: Any, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        ch = self._comp_channel
        while True:
            n, wcs = cq.poll(1)
            if n:
                return wcs[0]
            if deadline is not None and time.monotonic() >= deadline:
                return None
            if ch is None:
                time.sleep(0.0005)
                continue
            cq.req_notify()
            n, wcs = cq.poll(1)
            if n:
                return wcs[0]
            if readable([ch.fd], 0.05):
                try:
                    ch.get_cq_event(cq)
                    cq.ack_events(1)
                except PyverbsRDMAError:
                    pass


# what softrdma.rdmacm.cmid's classes look for to hand a new object to this module
CMEventChannel._hw_cm = CMEvent._hw_cm = CMID._hw_cm = sys.modules[__name__]
