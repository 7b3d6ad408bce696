"""rdma_cm events on librdmacm: :class:`CMEventChannel` (``rdma_event_channel``),
:class:`CMEvent` and :class:`Event` (an ``rdma_cm_event`` copied out and acknowledged at
once: ``rdma_destroy_id`` and ``rdma_migrate_id`` wait for unacknowledged events)."""

from __future__ import annotations

import ctypes
import errno
from ctypes import byref, c_void_p
from typing import Any

from ..readiness import readable
from ..errors import PyverbsRDMAError
from ..rdmacm.enums import event_str, rdma_cm_event_type as E
from . import cma_ffi as F, convert
from .cma_id import RdmaCmId, ids_on

__all__ = ["CMEventChannel", "CMEvent", "Event", "UDInfo"]


# ---- events -----------------------------------------------------------------------------------

class Event:
    """An ``rdma_cm_event`` copied out of librdmacm (already acknowledged)."""

    def __init__(self, c: F.rdma_cm_event, channel: "CMEventChannel") -> None:
        self.id = RdmaCmId.of(c.id, channel)
        self.listen_id = RdmaCmId.of(c.listen_id, channel) if c.listen_id else None
        self.event, self.status = c.event, c.status
        ud = self.id is not None and self.id.is_ud
        p = c.param.ud if ud else c.param.conn
        n = p.private_data_len
        self.private_data = ctypes.string_at(p.private_data, n) if p.private_data and n else b""
        self.conn: Any = None
        self.ud: Any = None
        if ud:
            self.ud = UDInfo(p.qp_num, p.qkey, convert.ah_attr_from_c(p.ah_attr))
        else:
            from ..rdmacm.cmid import ConnParam
            cp = ConnParam(resources=p.responder_resources, depth=p.initiator_depth,
                           flow_control=p.flow_control & 1, retry=p.retry_count,
                           rnr_retry=p.rnr_retry_count, srq=p.srq & 1,
                           qp_num=p.qp_num & 0xFFFFFF, data_len=len(self.private_data))
            cp.set_private_data(self.private_data)
            self.conn = cp.params


class UDInfo:
    """``rdma_ud_param``: how to reach a UD service (``qp_num``, ``qkey``, ``ah_attr``)."""

    def __init__(self, qp_num: int, qkey: int, ah_attr: Any) -> None:
        self.qp_num, self.qkey, self.ah_attr = qp_num, qkey, ah_attr


class CMEventChannel:
    """``rdma_event_channel`` of librdmacm: ``fd`` is readable while an event waits."""

    def __init__(self) -> None:
        self.closed = True
        h = F.need().rdma_create_event_channel()
        if not h:
            err = ctypes.get_errno() or errno.ENODEV
            why = " (no /dev/infiniband/rdma_cm: is rdma_ucm loaded?)" \
                if err in (errno.ENODEV, errno.ENOENT) else ""
            raise PyverbsRDMAError(f"Failed to create event channel (librdmacm){why}", err)
        self.handle: int = h
        self.closed = False

    @property
    def fd(self) -> int:
        return F.rdma_event_channel.from_address(self.handle).fd

    def wait(self, timeout: float | None) -> bool:
        """Block up to ``timeout`` seconds (None: for ever) until an event waits; no event
        is taken. True when one does."""
        self._check()
        t = None if timeout is None else max(0.0, timeout)
        return bool(readable([self.fd], t))

    def pending(self) -> bool:
        return self.wait(0)

    def get(self, timeout: float | None = None) -> Event:
        """The next event (``rdma_get_cm_event``, then ``rdma_ack_cm_event``); ETIMEDOUT
        when none comes within ``timeout`` seconds."""
        if not self.wait(timeout):
            raise PyverbsRDMAError("rdma_get_cm_event: no event", errno.ETIMEDOUT)
        p = c_void_p()
        F.call("rdma_get_cm_event failed", "rdma_get_cm_event", self.handle, byref(p))
        try:
            ev = Event(F.rdma_cm_event.from_address(p.value), self)
        finally:
            F.need().rdma_ack_cm_event(p.value)
        if ev.event == E.RDMA_CM_EVENT_CONNECT_RESPONSE and ev.id is not None and \
                ev.id.qp is not None:
            _complete_connect(ev)
        return ev

    def get_cm_event(self, timeout: float | None = None) -> "CMEvent":
        return CMEvent(self, timeout)

    def _check(self) -> None:
        if self.closed:
            raise PyverbsRDMAError("rdma_get_cm_event: the event channel is closed",
                                   errno.EBADF)

    def close(self) -> None:
        """Destroy the ids still on the channel (librdmacm would otherwise keep ids whose
        channel is freed), then the channel."""
        if not self.closed:
            self.closed = True
            for rid in ids_on(self):
                rid.destroy()
            F.need().rdma_destroy_event_channel(self.handle)

    def __enter__(self) -> "CMEventChannel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _complete_connect(ev: Event) -> None:
    """``ucma_process_conn_resp``: the REP arrived; our QP to RTS, RTU out, and the event
    is ESTABLISHED (CONNECT_ERROR with the QP in ERR if a step fails)."""
    rid = ev.id
    try:
        rid.to_rts()
        F.call("rdma_establish failed", "rdma_establish", rid.addr)
        ev.event = E.RDMA_CM_EVENT_ESTABLISHED
    except PyverbsRDMAError as e:
        ev.event, ev.status = E.RDMA_CM_EVENT_CONNECT_ERROR, -(e.error_code or errno.EIO)
        try:
            rid.qp.to_error()
        except PyverbsRDMAError:
            pass


class CMEvent:
    """``rdma_cm_event`` read from a hardware channel; the soft CMEvent's accessors."""

    def __init__(self, channel: CMEventChannel, timeout: float | None = None) -> None:
        if not isinstance(channel, CMEventChannel):
            raise PyverbsRDMAError("Failed to create CMEvent: channel must be a "
                                   f"CMEventChannel, not {type(channel).__name__}",
                                   errno.EINVAL)
        self._ev = channel.get(timeout)
        self.event: Event | None = self._ev

    event_type = property(lambda self: self._ev.event)
    status = property(lambda self: self._ev.status)
    private_data = property(lambda self: self._ev.private_data)
    id = property(lambda self: self._ev.id)
    listen_id = property(lambda self: self._ev.listen_id)

    @property
    def param(self) -> Any:
        return self._ev.ud if self._ev.ud is not None else self._ev.conn

    def event_str(self) -> str:
        return event_str(self._ev.event)

    def ack_cm_event(self) -> None:
        self.event = None  # acknowledged when read

    close = ack_cm_event

    def __repr__(self) -> str:
        return f"CMEvent({event_str(self._ev.event)}, status={self._ev.status})"
