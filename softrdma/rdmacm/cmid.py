"""The rdma_cm API in the shape of ``pyverbs.cmid``: :class:`CMEventChannel`,
:class:`CMEvent`, :class:`CMID`, :class:`AddrInfo`, :class:`ConnParam`, :class:`UDParam`.

Two styles, as librdmacm has them (docs/cm.md, "rdma_cm from Python"):

* **events**: ``CMID(channel)``; ``resolve_addr``/``resolve_route``/``connect`` (or
  ``bind_addr``/``listen``) return at once and each outcome arrives as a
  :class:`CMEvent` read from the channel (whose ``fd`` works with select and asyncio);
* **synchronous**: ``CMID(AddrInfo(...))`` (``rdma_create_ep``) resolves at once and every
  call returns when its outcome is known: ``get_request``, ``accept``, ``connect``, then
  ``post_send``/``post_recv``/``get_send_comp``/``get_recv_comp`` on the id's own QP.

Errors are :class:`PyverbsRDMAError` with the errno librdmacm gives (EINVAL naming the
field, ECONNREFUSED for a rejected connection, ETIMEDOUT for an unreachable peer).
"""

from __future__ import annotations

import errno
import time
from ipaddress import ip_address
import copy
from typing import Any

from ..readiness import readable
from ..errors import PyverbsRDMAError, PyverbsUserError
from .channel import EventChannel
from .cm_id import RdmaCmId
from .events import ConnParams, RdmaCmEvent
from .enums import (
    RAI_PASSIVE, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, RDMA_OPTION_ID_REUSEADDR,
    RDMA_OPTION_ID_TOS, RDMA_PS_IB, RDMA_PS_TCP, RDMA_PS_UDP, RDMA_UDP_QKEY, event_str,
    rdma_cm_event_type as E,
)

__all__ = ["CMEventChannel", "CMEvent", "CMID", "CMIDBase", "AddrInfo", "ConnParam", "UDParam"]

#: how long a synchronous call waits for its event (librdmacm waits for ever; a bound
#: keeps a lost peer from hanging a program: the CM itself gives up after ~100 s)
SYNC_TIMEOUT = 120.0

#: the errno a synchronous call fails with when its event is one of these (librdmacm's)
_WAIT_ERRNO = {E.RDMA_CM_EVENT_REJECTED: errno.ECONNREFUSED,
               E.RDMA_CM_EVENT_UNREACHABLE: errno.ETIMEDOUT,
               E.RDMA_CM_EVENT_ADDR_ERROR: errno.EHOSTUNREACH,
               E.RDMA_CM_EVENT_ROUTE_ERROR: errno.EHOSTUNREACH}


def _hardware(parent: Any, ask: bool) -> Any:
    """softrdma.ibverbs.cma when the new object runs on librdmacm, else None (soft): a
    hardware channel or event carries that module as ``_hw_cm``; a new channel, or an id
    made from an AddrInfo (``ask``), follows the backend (docs/backends.md, "rdma_cm")."""
    hw = getattr(parent, "_hw_cm", None)
    if hw is None and ask:
        from ..verbs_api.device import get_backend
        if get_backend() != "soft":  # soft never imports the hardware backend
            from ..ibverbs.cma_select import on_hardware
            if on_hardware(parent):
                from ..ibverbs import cma as hw
    return hw


class CMEventChannel:
    """softrdma's ``pyverbs.cmid.CMEventChannel`` (librdmacm's ``rdma_event_channel``):
    where the events of the ids created on it, or migrated to it, arrive."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        hw = _hardware(None, True)
        return object.__new__(cls) if hw is None else hw.CMEventChannel(*args, **kwargs)

    def __init__(self) -> None:
        self.channel = EventChannel()

    @property
    def fd(self) -> int:
        """Readable while an event waits (select, poll, asyncio ``add_reader``)."""
        return self.channel.fd

    def get_cm_event(self, timeout: float | None = None) -> "CMEvent":
        return CMEvent(self, timeout)

    def wait(self, timeout: float | None) -> None:
        """Block until an event is queued or ``timeout`` seconds pass (None: no limit; a
        negative timeout counts as 0), taking none. On a manual device (no progress
        thread) it moves the device one step and returns early: loop on it."""
        self.channel.wait(timeout)

    def pending(self) -> bool:
        """Whether an event is queued (``get_cm_event`` would return it at once)."""
        return self.channel.pending() > 0

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "CMEventChannel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class CMEvent:
    """``rdma_cm_event``, read from a channel (``rdma_get_cm_event``; blocks up to
    ``timeout`` seconds, for ever by default). ``event_type``, ``status``,
    ``private_data``, ``event_str()``; ``ack_cm_event()`` is accepted and does nothing
    (events hold no kernel resources here)."""

    def __new__(cls, channel: Any = None, *args: Any, **kwargs: Any) -> Any:
        hw = _hardware(channel, False)
        return object.__new__(cls) if hw is None else hw.CMEvent(channel, *args, **kwargs)

    def __init__(self, channel: CMEventChannel, timeout: float | None = None) -> None:
        if not isinstance(channel, CMEventChannel):
            raise PyverbsRDMAError("Failed to create CMEvent: channel must be a "
                                   f"CMEventChannel, not {type(channel).__name__}",
                                   errno.EINVAL)
        self.event: RdmaCmEvent | None = channel.channel.get(timeout)
        self._ev = self.event

    @property
    def event_type(self) -> int:
        return self._ev.event

    @property
    def status(self) -> int:
        return self._ev.status

    @property
    def private_data(self) -> bytes:
        return self._ev.private_data

    @property
    def param(self) -> Any:
        """The connection (``ConnParams``) or UD parameters the event carries."""
        return self._ev.ud if self._ev.ud is not None else self._ev.conn

    @property
    def id(self) -> RdmaCmId:
        return self._ev.id

    @property
    def listen_id(self) -> RdmaCmId | None:
        return self._ev.listen_id

    def event_str(self) -> str:
        return event_str(self._ev.event) if self.event is not None or self._ev else ""

    def ack_cm_event(self) -> None:
        self.event = None

    def close(self) -> None:
        self.event = None

    def __repr__(self) -> str:
        return f"CMEvent({event_str(self._ev.event)}, status={self._ev.status})"


class ConnParam:
    """``rdma_conn_param`` (pyverbs' defaults). ``data_len`` sizes the private data
    buffer; ``set_private_data`` fills it."""

    def __init__(self, resources: int = 1, depth: int = 1, flow_control: int = 0,
                 retry: int = 5, rnr_retry: int = 5, srq: int = 0, qp_num: int = 0,
                 data_len: int = 0) -> None:
        for name, v, top in (("resources", resources, 0xFF), ("depth", depth, 0xFF),
                             ("flow_control", flow_control, 1), ("retry", retry, 0xFF),
                             ("rnr_retry", rnr_retry, 0xFF), ("srq", srq, 1),
                             ("qp_num", qp_num, 0xFFFFFF), ("data_len", data_len, 1 << 16)):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= top:
                raise PyverbsRDMAError(f"ConnParam: {name}={v!r:.40} is not 0..{top}",
                                       errno.EINVAL)
        self.params = ConnParams(responder_resources=resources, initiator_depth=depth,
                                 flow_control=flow_control, retry_count=retry,
                                 rnr_retry_count=rnr_retry, srq=srq, qp_num=qp_num)
        self.data_len = data_len

    @property
    def qpn(self) -> int:
        return self.params.qp_num

    @qpn.setter
    def qpn(self, val: int) -> None:
        self.params.qp_num = val

    @property
    def private_data(self) -> bytes:
        return self.params.private_data

    def set_private_data(self, data: bytes) -> None:
        """Copy up to ``data_len`` bytes of ``data`` as the private data (pyverbs)."""
        n = min(self.data_len, len(data))
        if n:
            self.params.private_data = bytes(data[:n])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["params"], name)

    def __str__(self) -> str:
        p = self.params
        return (f"Connection parameters: \nresponder resources: {p.responder_resources}\n"
                f"initiator depth: {p.initiator_depth}\nflow control: {p.flow_control}\n"
                f"retry count: {p.retry_count}\nrnr retry count: {p.rnr_retry_count}\n"
                f"srq: {p.srq}\nqp number: {p.qp_num}\n")


class UDParam:
    """``rdma_ud_param`` of an ESTABLISHED event on a UD id: ``qp_num``, ``qkey``,
    ``ah_attr`` (an :class:`~softrdma.verbs_api.AHAttr` to reach the service)."""

    def __init__(self, cm_event: CMEvent) -> None:
        ud = cm_event._ev.ud
        if ud is None:
            raise PyverbsUserError("UDParam: the event carries no UD parameters")
        self.ud_param = ud

    @property
    def qp_num(self) -> int:
        return self.ud_param.qp_num

    @property
    def qkey(self) -> int:
        return self.ud_param.qkey

    @property
    def ah_attr(self) -> Any:
        return self.ud_param.ah_attr


class AddrInfo:
    """``rdma_addrinfo`` from ``rdma_getaddrinfo``: numeric addresses and ports only
    (no DNS, as RAI_NUMERICHOST). ``RAI_PASSIVE`` in ``flags`` makes it a listener's
    address (``src``/``src_service``, or the wildcard)."""

    def __init__(self, src: Any = None, dst: Any = None, src_service: Any = None,
                 dst_service: Any = None, port_space: int = 0, flags: int = 0) -> None:
        self.flags = flags
        self.port_space = port_space or RDMA_PS_TCP
        if self.port_space not in (RDMA_PS_TCP, RDMA_PS_UDP, RDMA_PS_IB):
            raise PyverbsRDMAError(f"Failed to get Address Info: port_space "
                                   f"{port_space!r:.40} is not RDMA_PS_TCP, _UDP or _IB",
                                   errno.EINVAL)
        self.src = self._addr(src, "src")
        self.dst = self._addr(dst, "dst")
        self.src_port = self._port(src_service, "src_service")
        self.dst_port = self._port(dst_service, "dst_service")
        if flags & RAI_PASSIVE:
            self.dst = None
        elif self.dst is None:
            raise PyverbsRDMAError("Failed to get Address Info: an active AddrInfo needs "
                                   "dst (or RAI_PASSIVE in flags)", errno.EINVAL)

    @staticmethod
    def _addr(v: Any, what: str) -> Any:
        if v is None:
            return None
        try:
            return ip_address(v.decode() if isinstance(v, bytes) else str(v))
        except ValueError:
            raise PyverbsRDMAError(f"Failed to get Address Info: {what}={v!r:.60} is not a "
                                   f"numeric IP address", errno.EINVAL) from None

    @staticmethod
    def _port(v: Any, what: str) -> int:
        if v is None:
            return 0
        try:
            p = int(v.decode() if isinstance(v, bytes) else v)
        except (TypeError, ValueError):
            p = -1
        if not 0 <= p <= 0xFFFF:
            raise PyverbsRDMAError(f"Failed to get Address Info: {what}={v!r:.40} is not a "
                                   f"port number", errno.EINVAL)
        return p

    def close(self) -> None:
        pass


def group_address(ai: Any) -> Any:
    """The multicast address given as an address or as an AddrInfo (its source, as pyverbs
    passes ``ai_src_addr``, else its destination)."""
    if not isinstance(ai, AddrInfo):
        return ai
    for v in (ai.src, ai.dst):
        if v is not None:
            return v
    raise PyverbsRDMAError("multicast: the AddrInfo names no address", errno.EINVAL)


class CMIDBase:
    """What both rdma_cm backends' CMIDs share (this module's soft one, and
    :class:`softrdma.ibverbs.cma.CMID` on librdmacm): the constructor's argument handling,
    the synchronous calls' waiting, the option checks, ``create_qp`` (the QP and CQs come
    from :meth:`_verbs`), the rdma_verbs.h helpers (``reg_msgs``, ``post_send``...),
    ``close`` of what was made for the id, and the context manager. A backend gives the
    rdma_cm calls themselves and the hooks named ``_``-something below."""

    #: the channel and event classes the constructor accepts (the backend's own)
    _channel_class: type = type(None)
    _event_class: type = type(None)

    @staticmethod
    def _verbs() -> Any:
        """Where the id's PD, MRs, QP and CQs come from (a subclass, such as
        pyverbs_compat's, gives its own classes)."""
        from .. import verbs_api
        return verbs_api

    def __init__(self, creator: Any = None, qp_init_attr: Any = None, pd: Any = None,
                 port_space: int = RDMA_PS_TCP, listen_id: "CMIDBase | None" = None) -> None:
        self.pd = pd
        self.ctx: Any = None
        self.event_channel: Any = None
        self.sync = False
        self.qp_init_attr = qp_init_attr
        self._owned: list[Any] = []  # what close() destroys: QP, CQs, PD made for the id
        self._comp_channel: Any = None
        self.id: Any = None
        self.closed = False
        if creator is None:
            return
        if isinstance(creator, self._channel_class):
            self.event_channel = creator
            self.id = self._create_id(creator, port_space)
        elif isinstance(creator, AddrInfo):
            self._create_ep(creator, qp_init_attr)
        elif isinstance(creator, self._event_class):
            if listen_id is None:
                raise PyverbsUserError("listen ID not provided")
            self.event_channel = listen_id.event_channel
            self.pd = listen_id.pd
            self.sync = listen_id.sync
            self._take_event_id(creator, listen_id)
        else:
            raise PyverbsRDMAError(f"Cannot create CM ID from {type(creator).__name__}",
                                   errno.EINVAL)

    # ---- what a backend gives -----------------------------------------------------------

    def _create_id(self, channel: Any, port_space: int) -> Any:
        """``rdma_create_id`` on ``channel``: the backend's id."""
        raise NotImplementedError

    def _create_ep(self, ai: AddrInfo, qp_init_attr: Any) -> None:
        """``rdma_create_ep``: bind or resolve ``ai`` on a channel of the id's own."""
        raise NotImplementedError

    def _take_event_id(self, event: Any, listen_id: "CMIDBase") -> None:
        """Make the id a CONNECT_REQUEST ``event`` carries this CMID's."""
        raise NotImplementedError

    def _take_request(self, to_conn: "CMIDBase", event: Any) -> None:
        """``get_request``: give ``to_conn`` the request's id on a channel of its own."""
        raise NotImplementedError

    def _has_device(self, cid: Any) -> bool:
        raise NotImplementedError

    def _set_id_option(self, cid: Any, optname: int, value: int) -> None:
        """``rdma_set_option`` of a checked option and value on ``cid``."""
        raise NotImplementedError

    def _init_qp_attr(self, qp_state: int) -> tuple[Any, int]:
        raise NotImplementedError

    def _get_comp(self, cq: Any, timeout: float | None) -> Any:
        raise NotImplementedError

    @property
    def context(self) -> Any:
        raise NotImplementedError

    # ---- shared --------------------------------------------------------------------------

    def _after_bind(self) -> None:
        if self.context is not None and self.pd is None:
            self.pd = self._verbs().PD(self.context)
            self._owned.append(self.pd)

    def _wait(self, want: int, what: str, timeout: float = SYNC_TIMEOUT) -> Any:
        """``ucma_complete``: the id's next event; an error unless it is ``want``."""
        ev = self._check().channel.get(timeout)
        if ev.event != want or ev.status:
            raise PyverbsRDMAError(f"{what}: {event_str(ev.event)} (status {ev.status})",
                                   _WAIT_ERRNO.get(ev.event, abs(ev.status) or errno.EINVAL))
        return ev

    def _check(self) -> Any:
        if self.closed or self.id is None:
            raise PyverbsRDMAError("the CMID is closed", errno.EBADF)
        return self.id

    @property
    def qp(self) -> Any:
        return self.id.qp if self.id is not None else None

    @property
    def qpn(self) -> int | None:
        return self.qp.qp_num if self.qp is not None else None

    def get_request(self, timeout: float | None = None) -> "CMIDBase":
        """``rdma_get_request`` (synchronous listener): the next connection request as a
        new CMID with its own channel, and a QP made with the listener's
        ``qp_init_attr`` if it has one."""
        cid = self._check()
        if not self.sync:
            raise PyverbsRDMAError("get_request: only for synchronous (AddrInfo) ids",
                                   errno.EINVAL)
        while True:
            ev = cid.channel.get(timeout)
            if ev.event == E.RDMA_CM_EVENT_CONNECT_REQUEST:
                break
        to_conn = type(self)()
        to_conn.sync = True
        self._take_request(to_conn, ev)
        to_conn._event = ev
        to_conn.pd = self.pd if self.pd is not None else self._verbs().PD(to_conn.context)
        if self.pd is None:
            to_conn._owned.append(to_conn.pd)
        if self.qp_init_attr is not None:
            to_conn.create_qp(self.qp_init_attr)
        return to_conn

    def set_option(self, level: int, optname: int, optval: int, optlen: int = 1) -> None:
        """``rdma_set_option``: RDMA_OPTION_ID_TOS, _REUSEADDR and _ACK_TIMEOUT."""
        cid = self._check()
        if level != RDMA_OPTION_ID:
            raise PyverbsRDMAError(f"set_option: level {level} is not RDMA_OPTION_ID",
                                   errno.ENOSYS)
        if optname == RDMA_OPTION_ID_ACK_TIMEOUT:
            if not 0 <= int(optval) <= 31:
                raise PyverbsRDMAError(f"set_option: ACK timeout {optval} is not 0..31",
                                       errno.EINVAL)
            value = int(optval)
        elif optname == RDMA_OPTION_ID_TOS:
            value = int(optval) & 0xFF
        elif optname == RDMA_OPTION_ID_REUSEADDR:
            value = 1 if optval else 0
        else:
            raise PyverbsRDMAError(f"set_option: option {optname} is not supported",
                                   errno.ENOSYS)
        self._set_id_option(cid, optname, value)

    # ---- the QP -------------------------------------------------------------------------

    def create_qp(self, qp_init: Any) -> None:
        """``rdma_create_qp``: a QP on the id's PD (CQs made for it when ``qp_init`` has
        none), moved to INIT (UD: to RTS) with rdma_cm's attributes."""
        v = self._verbs()
        cid = self._check()
        if not self._has_device(cid):
            raise PyverbsRDMAError("Failed to Create QP: the id has no device (resolve or "
                                   "bind an address first)", errno.EINVAL)
        if self.pd is None:
            self._after_bind()
        if qp_init.scq is None or qp_init.rcq is None:
            qp_init = copy.copy(qp_init)
            self._comp_channel = v.CompChannel(self.context)
            self._owned.append(self._comp_channel)
            for side, depth in (("scq", qp_init.cap.max_send_wr),
                                ("rcq", qp_init.cap.max_recv_wr)):
                if getattr(qp_init, side) is None:
                    cq = v.CQ(self.context, max(depth, 1), None, self._comp_channel)
                    setattr(qp_init, side, cq)
                    self._owned.append(cq)
        qp = v.QP(self.pd, qp_init)
        try:
            cid.attach_qp(qp)
        except BaseException:
            qp.close()
            raise
        self._owned.append(qp)

    def query_qp(self, attr_mask: int) -> Any:
        return self._qp("query_qp").query(attr_mask)

    def init_qp_attr(self, qp_state: int) -> tuple[Any, int]:
        from ..verbs_api.enums import ibv_qp_state as Q
        if qp_state not in (Q.IBV_QPS_INIT, Q.IBV_QPS_RTR, Q.IBV_QPS_RTS):
            raise PyverbsRDMAError(f"Failed to get QP attributes: state {qp_state} is not "
                                   f"INIT, RTR or RTS", errno.EINVAL)
        return self._init_qp_attr(qp_state)

    def _qp(self, what: str) -> Any:
        qp = self._check().qp
        if qp is None:
            raise PyverbsRDMAError(f"{what}: the CMID has no QP", errno.EINVAL)
        return qp

    # ---- memory and messages (rdma_verbs.h) -------------------------------------------

    def _mr(self, size: int, access: int) -> Any:
        MR = self._verbs().MR
        self._check()
        if self.pd is None:
            raise PyverbsRDMAError("Failed to register MR: the CMID has no PD yet",
                                   errno.EINVAL)
        return MR(self.pd, size, access)

    def reg_msgs(self, size: int) -> Any:
        from ..verbs_api.enums import ibv_access_flags as A
        return self._mr(size, A.IBV_ACCESS_LOCAL_WRITE)

    def reg_read(self, size: int = 0) -> Any:
        from ..verbs_api.enums import ibv_access_flags as A
        return self._mr(size, A.IBV_ACCESS_LOCAL_WRITE | A.IBV_ACCESS_REMOTE_READ)

    def reg_write(self, size: int = 0) -> Any:
        from ..verbs_api.enums import ibv_access_flags as A
        return self._mr(size, A.IBV_ACCESS_LOCAL_WRITE | A.IBV_ACCESS_REMOTE_WRITE)

    def post_recv(self, mr: Any, length: int | None = None) -> None:
        from ..verbs_api import SGE, RecvWR
        qp = self._qp("Failed to Post Receive")
        qp.post_recv(RecvWR(0, 1, [SGE(mr.buf, length or mr.length, mr.lkey)]))

    def post_send(self, mr: Any, flags: int | None = None, length: int | None = None) -> None:
        from ..verbs_api import SGE, SendWR
        from ..verbs_api.enums import ibv_send_flags as F, ibv_wr_opcode as O
        qp = self._qp("Failed to Post Send")
        flags = F.IBV_SEND_SIGNALED if flags is None else flags
        qp.post_send(SendWR(0, O.IBV_WR_SEND, 1, sg=[SGE(mr.buf, length or mr.length,
                                                         mr.lkey)], send_flags=flags))

    def _post_rdma(self, opcode: int, what: str, mr: Any, length: int, remote_addr: int,
                   rkey: int, flags: int) -> None:
        from ..verbs_api import SGE, SendWR
        qp = self._qp(what)
        wr = SendWR(0, opcode, 1, sg=[SGE(mr.buf, length, mr.lkey)], send_flags=flags)
        wr.set_wr_rdma(rkey, remote_addr)
        qp.post_send(wr)

    def post_read(self, mr: Any, length: int, remote_addr: int, rkey: int,
                  flags: int = 0) -> None:
        from ..verbs_api.enums import ibv_wr_opcode as O
        self._post_rdma(O.IBV_WR_RDMA_READ, "Failed to Post Read", mr, length,
                        remote_addr, rkey, flags)

    def post_write(self, mr: Any, length: int, remote_addr: int, rkey: int,
                   flags: int = 0) -> None:
        from ..verbs_api.enums import ibv_wr_opcode as O
        self._post_rdma(O.IBV_WR_RDMA_WRITE, "Failed to Post Write", mr, length,
                        remote_addr, rkey, flags)

    def post_ud_send(self, mr: Any, ah: Any, rqpn: int = 0, flags: int | None = None,
                     length: int | None = None) -> None:
        from ..verbs_api import SGE, SendWR
        from ..verbs_api.enums import ibv_send_flags as F, ibv_wr_opcode as O
        qp = self._qp("Failed to Post Send")
        flags = F.IBV_SEND_SIGNALED if flags is None else flags
        wr = SendWR(0, O.IBV_WR_SEND, 1, sg=[SGE(mr.buf, length or mr.length, mr.lkey)],
                    send_flags=flags)
        wr.set_wr_ud(ah, rqpn, RDMA_UDP_QKEY)
        qp.post_send(wr)

    def get_send_comp(self, timeout: float | None = None) -> Any:
        """``rdma_get_send_comp``: block until the send CQ has a completion (its WC)."""
        return self._get_comp(self._qp("Failed to retrieve send completion").send_cq,
                              timeout)

    def get_recv_comp(self, timeout: float | None = None) -> Any:
        """``rdma_get_recv_comp``: block until the receive CQ has a completion."""
        return self._get_comp(self._qp("Failed to retrieve receive completion").recv_cq,
                              timeout)

    # ---- the end ----------------------------------------------------------------------

    def close(self) -> None:
        """``rdma_destroy_ep`` / ``rdma_destroy_qp`` + ``rdma_destroy_id``: the QP, the
        CQs and PD made for the id, then the id (saying goodbye on the wire as Linux
        does). Idempotent."""
        if self.closed:
            return
        self.closed = True
        cid = self.id
        if cid is not None:
            cid.qp = None if any(o is cid.qp for o in self._owned) else cid.qp
        for obj in reversed(self._owned):
            try:
                obj.close()
            except Exception:
                pass
        self._owned.clear()
        if cid is not None:
            cid.destroy()
        ch = getattr(self, "_sync_channel", None)
        if ch is not None:
            ch.close()

    def __enter__(self) -> "CMIDBase":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CMID({self.id!r})"


class CMID(CMIDBase):
    """softrdma's ``pyverbs.cmid.CMID``: a librdmacm ``rdma_cm_id`` for Python, with the
    rdma_verbs.h helpers (``reg_msgs``, ``post_send``, ``get_recv_comp``...). It holds
    the rdma_cm id proper (:class:`~softrdma.rdmacm.cm_id.RdmaCmId`, :attr:`id`) and the
    PD, QP and CQs made for it. ``CMID(channel, port_space=...)`` for the event style,
    ``CMID(AddrInfo(...), qp_init_attr, pd)`` for the synchronous one
    (``rdma_create_ep``), ``CMID(event, listen_id=listener)`` for the id a
    CONNECT_REQUEST carries. What does not depend on the backend is :class:`CMIDBase`'s."""

    _channel_class = CMEventChannel
    _event_class = CMEvent

    def __new__(cls, creator: Any = None, *args: Any, **kwargs: Any) -> Any:
        hw = _hardware(creator, isinstance(creator, AddrInfo))
        return object.__new__(cls) if hw is None else hw.CMID(creator, *args, **kwargs)

    def _create_id(self, channel: CMEventChannel, port_space: int) -> RdmaCmId:
        return RdmaCmId(channel.channel, port_space, self)

    def _take_event_id(self, event: CMEvent, listen_id: CMIDBase) -> None:
        self.id = event._ev.id
        self.id.context = self
        self.ctx = listen_id.ctx or (self.id.cdev.ctx if self.id.cdev else None)

    def _take_request(self, to_conn: CMIDBase, event: RdmaCmEvent) -> None:
        to_conn.id = event.id
        to_conn.id.context = to_conn
        to_conn._sync_channel = EventChannel()  # rdma_migrate_id to a channel of its own
        to_conn._sync_channel.adopt(to_conn.id)
        to_conn.ctx = event.id.cdev.ctx

    def _has_device(self, cid: RdmaCmId) -> bool:
        return cid.cdev is not None

    def _set_id_option(self, cid: RdmaCmId, optname: int, value: int) -> None:
        if optname == RDMA_OPTION_ID_ACK_TIMEOUT:
            cid.ack_timeout = value
        elif optname == RDMA_OPTION_ID_TOS:
            cid.tos = value
        else:
            cid.reuseaddr = bool(value)

    def _init_qp_attr(self, qp_state: int) -> tuple[Any, int]:
        from ..verbs_api.enums import ibv_qp_state as Q
        names = {Q.IBV_QPS_INIT: "INIT", Q.IBV_QPS_RTR: "RTR", Q.IBV_QPS_RTS: "RTS"}
        return self._check().init_qp_attr(names[qp_state])

    # ---- synchronous plumbing -------------------------------------------------------

    def _create_ep(self, ai: AddrInfo, qp_init_attr: Any) -> None:
        """``rdma_create_ep``: an id with its own channel, bound (passive) or resolved
        (active), with a QP if ``qp_init_attr`` is given (active side)."""
        self.sync = True
        self._sync_channel = EventChannel()
        self.id = RdmaCmId(self._sync_channel, ai.port_space, self)
        try:
            if ai.flags & RAI_PASSIVE:
                self.id.bind_addr(ai.src, ai.src_port)
                self._after_bind()
                return
            self.id.resolve_addr(ai.src, ai.dst, ai.dst_port)
            self._wait(E.RDMA_CM_EVENT_ADDR_RESOLVED, "Failed to create CM ID")
            self.id.resolve_route()
            self._wait(E.RDMA_CM_EVENT_ROUTE_RESOLVED, "Failed to create CM ID")
            self._after_bind()
            if qp_init_attr is not None:
                self.create_qp(qp_init_attr)
        except BaseException:
            self.close()
            raise

    # ---- properties -------------------------------------------------------------------

    @property
    def context(self) -> Any:
        """The verbs context of the id's device (None before the id has one)."""
        if self.ctx is None and self.id is not None and self.id.cdev is not None:
            self.ctx = self.id.cdev.ctx
        return self.ctx

    @property
    def dev_name(self) -> str:
        return self.id.device.name if self.id is not None and self.id.cdev else ""

    @property
    def port_num(self) -> int:
        return 1

    @property
    def local_addr(self) -> tuple[str, int]:
        """The id's own address and port, as ``getsockname`` gives them (the wildcard
        address while a wildcard-bound id has no device, port 0 while unbound; a closed
        id keeps its last address)."""
        cid = self.id
        if cid is None:
            return ("0.0.0.0", 0)
        ip = cid.local_ip
        return (str(ip) if ip is not None else "0.0.0.0", cid.src_port)

    @property
    def peer_addr(self) -> tuple[str, int]:
        """The peer's address and port, as ``getpeername`` gives them; ENOTCONN before a
        destination is known (an id that only listens)."""
        cid = self.id
        if cid is None or cid.dst_ip is None:
            raise PyverbsRDMAError("peer_addr: the id has no peer", errno.ENOTCONN)
        return (str(cid.dst_ip), cid.dst_port)

    @property
    def path_ack_timeout(self) -> int:
        """The local ACK timeout exponent (4.096 us x 2^t) of the connection's path: the
        CM REQ's ``primary_local_ack_timeout`` on the passive side, the route's packet
        lifetime + 1 on the active side (what cm.c gives the QP); 0 if not known yet."""
        return self.id.path_ack_timeout if self.id is not None else 0

    def migrate(self, channel: CMEventChannel) -> None:
        """``rdma_migrate_id``: this id's later events go to ``channel``."""
        if not isinstance(channel, CMEventChannel):
            raise PyverbsRDMAError(f"migrate: channel must be a CMEventChannel, not "
                                   f"{type(channel).__name__}", errno.EINVAL)
        channel.channel.adopt(self._check())
        self.event_channel = channel

    # ---- addressing and connecting ----------------------------------------------------

    def bind_addr(self, lai: AddrInfo) -> None:
        self._check().bind_addr(lai.src, lai.src_port)
        self._after_bind()

    def resolve_addr(self, rai: AddrInfo, timeout_ms: int = 2000) -> None:
        self._check().resolve_addr(rai.src, rai.dst, rai.dst_port, timeout_ms)
        if self.sync:
            self._wait(E.RDMA_CM_EVENT_ADDR_RESOLVED, "Failed to Resolve Address")

    def resolve_route(self, timeout_ms: int = 2000) -> None:
        self._check().resolve_route(timeout_ms)
        if self.sync:
            self._wait(E.RDMA_CM_EVENT_ROUTE_RESOLVED, "Failed to Resolve Route")
        self._after_bind()

    def listen(self, backlog: int = 0) -> None:
        self._check().listen(backlog)
        self._after_bind()

    def connect(self, param: ConnParam | None = None) -> None:
        self._check().connect(param.params if param is not None else None)
        if self.sync:
            self._wait(E.RDMA_CM_EVENT_ESTABLISHED, "Failed to Connect")

    def accept(self, param: ConnParam | None = None) -> None:
        cid = self._check()
        cid.accept(param.params if param is not None else None)
        if self.sync and not cid.is_ud:
            self._wait(E.RDMA_CM_EVENT_ESTABLISHED, "Failed to Accept Connection")

    def establish(self) -> None:
        self._check().establish()

    def reject(self, private_data: bytes | None = None) -> None:
        self._check().reject(private_data or b"")

    def disconnect(self) -> None:
        cid = self._check()
        cid.disconnect()
        if self.sync:
            try:
                self._wait(E.RDMA_CM_EVENT_DISCONNECTED, "Failed to Disconnect", 10.0)
            except PyverbsRDMAError:
                pass

    # ---- multicast ------------------------------------------------------------------

    def join_multicast(self, addr: Any, context: Any = None, join_flags: int = 0) -> None:
        """``rdma_join_multicast_ex``: join the group ``addr`` (an address, or an AddrInfo
        whose ``src`` or ``dst`` is the group); RDMA_CM_EVENT_MULTICAST_JOIN carries the
        UD parameters that reach it (QPN 0xFFFFFF, RDMA_UDP_QKEY, an AH to the group) and
        the id's QP is attached (a full member's; ``join_flags`` 1 is send-only). A
        synchronous id waits for the event. See :meth:`RdmaCmId.join_multicast`."""
        self._check().join_multicast(group_address(addr), context, join_flags)
        if self.sync:
            self._wait(E.RDMA_CM_EVENT_MULTICAST_JOIN, "Failed to Join multicast")

    def leave_multicast(self, addr: Any) -> None:
        """``rdma_leave_multicast``: the QP detached, the group forgotten."""
        self._check().leave_multicast(group_address(addr))

    def _get_comp(self, cq: Any, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        manual = self._check().channel.manual_devices()
        while True:
            n, wcs = cq.poll(1)
            if n:
                return wcs[0]
            if deadline is not None and time.monotonic() >= deadline:
                return None
            if manual:
                for dev in manual:
                    with dev.lock:
                        dev.progress()
            else:
                ch = getattr(self, "_comp_channel", None)
                if ch is not None:
                    cq.req_notify()
                    n, wcs = cq.poll(1)
                    if n:
                        return wcs[0]
                    left = 0.05 if deadline is None else \
                        max(0.0, min(0.05, deadline - time.monotonic()))
                    if readable([ch.fd], left):  # else get_cq_event would block: no event
                        try:
                            ch.get_cq_event(cq, timeout=0)
                            cq.ack_events(1)
                        except Exception:
                            pass
                else:
                    time.sleep(0.0005)
