"""The rdma_cm id (``struct rdma_cm_id``; cma.c's ``rdma_id_private`` and librdmacm's
``cma_id_private``): IP addressing and connection management over the IB CM.

What the kernel's ``drivers/infiniband/core/cma.c`` and librdmacm's ``cma.c`` do between
them, for soft devices:

* **addresses** (:meth:`RdmaCmId.bind_addr`, :meth:`RdmaCmId.resolve_addr`): an IP
  address names a device (the soft device holding it, :mod:`.addr`) and a port in a port
  space (TCP for RC, UDP for UD, IB for either; :mod:`.ports`); an unbound id gets an
  ephemeral port;
* **routes** (:meth:`RdmaCmId.resolve_route`): on RoCE there is no SA; the path is made
  locally (``cma_resolve_iboe_route``, :class:`~.addr.Route`);
* **connections**: REQ/REP/RTU through the device's :class:`~softrdma.soft.cm_service.CmService`
  (:mod:`.device`) with the cma header in the REQ's private data, the QP moved INIT ->
  RTR -> RTS with the attributes ``rdma_init_qp_attr`` gives (PSNs crossed, responder
  resources and initiator depth swapped), REJ, DREQ/DREP, and SIDR for UD;
* **events**: each id reports to its :class:`~.channel.EventChannel` the
  ``RDMA_CM_EVENT_*`` Linux reports, when Linux reports them (docs/cm.md, "rdma_cm");
* **states**: every change of :attr:`RdmaCmId.state` is a row of cma.c's transitions
  (:mod:`.state`), taken by :meth:`RdmaCmId._move`.

Threads: CM events arrive with the device lock held (usually on the progress thread) and
are turned into rdma_cm events there; every consumer call takes the same lock, so an id
never sees two things at once. Nothing here blocks while holding it.
"""

from __future__ import annotations

import errno
import random
import threading
from contextlib import contextmanager, nullcontext
from ipaddress import ip_address
from typing import Any, Iterator

from ..cm.cma import CmaError, CmaHeader, gid_from_ip, service_id
from ..cm.messages import RejectReason, SidrStatus
from ..cm.state import MRA_FLAG_DELAY, CmEvent, CmEventType, CmStateError, IbCmId, CmState
from ..errors import PyverbsRDMAError
from ..verbs_api.attr import GID, AHAttr, GlobalRoute, QPAttr
from ..verbs_api.enums import (
    ibv_access_flags as A, ibv_qp_attr_mask as M, ibv_qp_state as Q, ibv_qp_type,
)
from .addr import (
    CMA_IBOE_PACKET_LIFETIME, IPAddress, NoDevice, Route, check_port, device_for_dst,
    device_for_ip, flow_label, interface_device, parse_ip, soft_devices,
)
from .channel import EventChannel
from .device import CmaDevice
from .enums import (
    RDMA_MAX_INIT_DEPTH, RDMA_MAX_RESP_RES, RDMA_PS_IB, RDMA_PS_IPOIB, RDMA_PS_TCP,
    RDMA_MC_JOIN_FLAG_FULLMEMBER, RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER,
    RDMA_PS_UDP, RDMA_UDP_QKEY, REJ_PRIVATE_DATA, REP_PRIVATE_DATA, REQ_PRIVATE_DATA,
    SIDR_REP_PRIVATE_DATA, SIDR_REQ_PRIVATE_DATA, RdmaCmState, rdma_cm_event_type as E,
)
from .events import ConnParams, RdmaCmEvent, UdParams
from ..soft.mcast import MULTICAST_QPN

ENOTSUPP = 524  # the kernel's ENOTSUPP (not EOPNOTSUPP): an IPv6 group on RoCEv2
IPV6_DEFAULT_HOPLIMIT = 64  # the hop limit of a RoCEv2 IPv4 group's AH
from .loopback import LOOPBACK
from .ports import PORTS
from .state import TRANSITIONS, next_state

__all__ = ["RdmaCmId", "RDMA_UCM_MAX_BACKLOG"]

#: rdma_cm constants (cma.c): CM response timeout, CM retries, the MRA setting it
#: answers every REQ and REP with (state only, 24 ~ 68 s)
CMA_CM_RESPONSE_TIMEOUT = 20
CMA_MAX_CM_RETRIES = 15
CMA_CM_MRA_SETTING = MRA_FLAG_DELAY | 24
ETIMEDOUT = errno.ETIMEDOUT
#: The most connection requests a listener holds for the application (queued
#: CONNECT_REQUEST events not yet taken): Linux's ``net.rdma_ucm.max_backlog`` sysctl
#: (drivers/infiniband/core/ucma.c, default 1024). ``listen(backlog)`` with a backlog <= 0
#: or above it gets it, as ``ucma_listen`` does.
RDMA_UCM_MAX_BACKLOG = 1024

_PS = {RDMA_PS_TCP, RDMA_PS_UDP, RDMA_PS_IB, RDMA_PS_IPOIB}


def _err(msg: str, code: int) -> PyverbsRDMAError:
    return PyverbsRDMAError(msg, code)


def _check_private(data: Any, limit: int, what: str) -> bytes:
    if data is None:
        return b""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _err(f"{what}: private_data must be bytes, not {type(data).__name__}",
                   errno.EINVAL)
    data = bytes(data)
    if len(data) > limit:
        raise _err(f"{what}: private_data is {len(data)} bytes, at most {limit} fit",
                   errno.EINVAL)
    return data




class RdmaCmId:
    """``struct rdma_cm_id`` with the kernel's ``rdma_id_private`` and librdmacm's
    ``cma_id_private`` in one: address, route, port space, QP, the IB CM id under it,
    and its state (:class:`RdmaCmState`).

    ``qp_type`` follows the port space (TCP: RC; UDP: UD; IB: RC unless a UD QP is
    attached). Events go to ``channel``."""

    def __init__(self, channel: EventChannel, ps: int = RDMA_PS_TCP, context: Any = None,
                 *, qp_type: int | None = None) -> None:
        if ps not in _PS:
            raise _err(f"rdma_create_id: port space {ps!r:.40} is not RDMA_PS_TCP, _UDP, "
                       f"_IB or _IPOIB", errno.EINVAL)
        if channel is None or channel.closed:
            raise _err("rdma_create_id: the event channel is closed", errno.EBADF)
        self.channel = channel
        channel.ids.add(self)
        self.ps = int(ps)
        self.context = context
        if qp_type is None:
            qp_type = ibv_qp_type.IBV_QPT_UD if ps in (RDMA_PS_UDP, RDMA_PS_IPOIB) \
                else ibv_qp_type.IBV_QPT_RC
        self.qp_type = int(qp_type)
        self._state = RdmaCmState.IDLE  # written by _move only
        self.cdev: CmaDevice | None = None
        self.src_ip: IPAddress | None = None
        self.src_loopback = False  # src_ip: a loopback address another process may hold
        self._published = False
        self.src_port = 0
        self.dst_ip: IPAddress | None = None
        self.dst_port = 0
        self.route: Route | None = None
        self.qp: Any = None
        self.cm: IbCmId | None = None
        self.listen_id: "RdmaCmId | None" = None
        self.backlog = 0  # a listener's: rdma_listen's, as ucma_listen clamps it
        self._backlog_left = 0  # ucma_context.backlog: room for CONNECT_REQUESTs
        self._backlog_lock = threading.Lock()  # the device thread and the taker's
        self._unreported: set["RdmaCmId"] = set()  # children whose request is queued
        self.reuseaddr = False
        self.tos = 0
        self.ack_timeout: int | None = None  # RDMA_OPTION_ID_ACK_TIMEOUT
        self.seq_num = random.getrandbits(24)  # our starting PSN: the PSN we receive first
        self.responder_resources = 0
        self.initiator_depth = 0
        self.retry_count = 7
        self.remote_qpn = 0
        self.remote_qkey = 0
        self.sq_psn = 0
        self.req: Any = None  # the REQ (sent or received)
        self.rep: Any = None  # the REP (sent or received)
        self.connect_error = False
        self.destroyed = False
        # joined groups, newest first (librdmacm's mc_list): (address, MGID, join flags)
        self.mcast: list[tuple[Any, bytes, int]] = []

    def __repr__(self) -> str:
        src = f"{self.src_ip}:{self.src_port}" if self.src_ip is not None else \
            f"*:{self.src_port}"
        dst = f" -> {self.dst_ip}:{self.dst_port}" if self.dst_ip is not None else ""
        return f"RdmaCmId({src}{dst}, {self.state.name})"

    # ---- state -------------------------------------------------------------------------

    @property
    def state(self) -> RdmaCmState:
        """``rdma_id_private.state``; it changes only along :data:`.state.TRANSITIONS`."""
        return self._state

    def _move(self, step: str, what: str = "") -> None:
        """Take ``step`` (a row of :data:`.state.TRANSITIONS`): the one place an id's
        state changes. EINVAL (cma.c's ``cma_comp_exch`` failing) if the state does not
        allow it."""
        self._state = next_state(step, self._state, what)

    def _can(self, step: str) -> bool:
        """Whether ``step`` is allowed now (an event handler drops what is not)."""
        return self._state in TRANSITIONS[step]

    def _check(self, step: str, what: str) -> None:
        """Refuse a call before it does anything: EBADF on a destroyed id, EINVAL
        unless ``step`` is allowed in the id's state."""
        if self.destroyed:
            raise _err(f"{what}: the id is destroyed", errno.EBADF)
        next_state(step, self._state, what)

    # ---- helpers ------------------------------------------------------------------------

    @property
    def device(self) -> Any:
        return self.cdev.device if self.cdev is not None else None

    @property
    def is_ud(self) -> bool:
        return self.qp_type == ibv_qp_type.IBV_QPT_UD

    def _lock(self) -> Any:
        return self.cdev.device.lock if self.cdev is not None else nullcontext()

    def _attach(self, dev: Any) -> None:
        if self.cdev is None:
            self.cdev = CmaDevice.acquire(dev)
            if not dev.live or dev.progress_thread is None:
                self.channel.watch(dev)

    def _event(self, ev: E, *, status: int = 0, conn: ConnParams | None = None,
               ud: UdParams | None = None, listen_id: "RdmaCmId | None" = None,
               cid: "RdmaCmId | None" = None) -> None:
        target = cid or self
        if target.destroyed:
            return
        target.channel.put(RdmaCmEvent(ev, target, listen_id, status, conn, ud))

    def _require(self, what: str, *states: RdmaCmState) -> None:
        if self.destroyed:
            raise _err(f"{what}: the id is destroyed", errno.EBADF)
        if self.state not in states:
            raise _err(f"{what}: the id is in state {self.state.name}, not "
                       f"{' or '.join(s.name for s in states)}", errno.EINVAL)

    # ---- addresses ----------------------------------------------------------------------

    def bind_addr(self, ip: Any = None, port: int = 0) -> None:
        """``rdma_bind_addr``: a local address (None or the wildcard: any device) and port
        (0: an ephemeral one). A specific address binds the id to its device: a non-loopback
        address of an UP interface gets one if none holds it (``interface_device``;
        EADDRINUSE when kernel rxe or another process has UDP 4791 there); ENODEV for an
        address no device can hold."""
        what = "rdma_bind_addr"
        self._check("bind_addr", what)
        addr = parse_ip(ip, what)
        port = check_port(port, what)
        dev = None
        keep: list[CmaDevice] = []
        self._move("bind_addr", what)
        try:
            if addr is not None and not addr.is_unspecified:
                dev = device_for_ip(addr, keep) or interface_device(addr, keep)
                if dev is None and addr.is_loopback:
                    # all of 127/8 (and ::1) is local: the device of this process, as
                    # Linux's cma_bind_loopback takes any device (LoopbackListeners)
                    dev = next((d for d in soft_devices()
                                if ip_address(d.ip).version == addr.version), None)
                    self.src_loopback = dev is not None
                if dev is None:
                    raise _err(f"{what}: no RDMA device has address {addr}", errno.ENODEV)
            else:
                addr = None
            self.src_port = PORTS.bind(self, addr, port)
            self.src_ip = addr
            if dev is not None:
                self._attach(dev)
        except BaseException:
            self._move("bind_addr_failed")
            raise
        finally:
            for c in keep:
                c.release()

    def resolve_addr(self, src: Any, dst: Any, dst_port: int = 0,
                     timeout_ms: int = 2000) -> None:
        """``rdma_resolve_addr``: pick the device a connection to ``dst`` leaves from
        (binding the id if it is not; an interface device on the route's source comes up
        if needed), then ADDR_RESOLVED, or ADDR_ERROR: status -ENETUNREACH when nothing
        reaches ``dst``, -EADDRINUSE (and one log line) when the route's source address
        has UDP 4791 taken by kernel rxe or another process."""
        what = "rdma_resolve_addr"
        if self.state != RdmaCmState.IDLE or self.destroyed:  # IDLE: bound first
            self._check("resolve_addr", what)
        daddr = parse_ip(dst, what)
        if daddr is None:
            raise _err(f"{what}: a destination address is required", errno.EINVAL)
        dst_port = check_port(dst_port, what)
        if self.state == RdmaCmState.IDLE:
            self.bind_addr(src, 0)
        elif src is not None and parse_ip(src, what) not in (None, self.src_ip):
            raise _err(f"{what}: the id is bound to {self.src_ip}, not {src}", errno.EINVAL)
        self._move("resolve_addr", what)
        try:
            if self.src_ip is not None and self.src_ip.version != daddr.version:
                raise _err(f"{what}: {self.src_ip} and {daddr} are of different families",
                           errno.EAFNOSUPPORT)
            self.dst_ip, self.dst_port = daddr, dst_port
            dev = self.device
            status = -errno.ENETUNREACH  # no device reaches dst, as Linux with no route
            if dev is None:
                keep: list[CmaDevice] = []
                try:
                    dev = device_for_dst(daddr, keep)
                    if dev is not None:
                        self._attach(dev)
                except NoDevice as e:  # the route's source is taken (logged)
                    status = -e.error_code
                finally:
                    for c in keep:
                        c.release()
        except BaseException:
            self._move("resolve_addr_failed")
            raise
        self._move("addr_resolved")  # addr_handler: resolved, or failed to find a device
        if dev is None:
            self._move("addr_error")
            self._event(E.RDMA_CM_EVENT_ADDR_ERROR, status=status)
            return
        self._event(E.RDMA_CM_EVENT_ADDR_RESOLVED)

    @property
    def local_ip(self) -> IPAddress | None:
        """The address this id uses: the bound one, or its device's."""
        if self.src_ip is not None and not self.src_loopback:
            return self.src_ip
        return ip_address(self.cdev.ip) if self.cdev is not None else None

    def _loopback_peer(self) -> None:
        """A loopback destination no local device holds: the device address of the
        process listening there (LoopbackListeners), as the route's destination."""
        dst = self.dst_ip
        if dst is None or not dst.is_loopback or self.route is None:
            return
        if any(ip_address(d.ip) == dst for d in soft_devices()):
            return
        peer = LOOPBACK.lookup(self.ps, dst, self.dst_port)
        if peer is not None and peer != dst:
            self.dst_ip = peer
            self.route.dgid = gid_from_ip(peer)

    def resolve_route(self, timeout_ms: int = 2000) -> None:
        """``rdma_resolve_route``, RoCE style (``cma_resolve_iboe_route``): no SA query;
        the path is built here and ROUTE_RESOLVED follows at once."""
        what = "rdma_resolve_route"
        self._check("resolve_route", what)
        self._move("resolve_route", what)
        try:
            dev = self.device
            sgid = gid_from_ip(self.local_ip)
            sgid_index = dev.gid_table.index(sgid) if sgid in dev.gid_table else 1
            self.route = Route(sgid=sgid, dgid=gid_from_ip(self.dst_ip),
                               sgid_index=sgid_index, path_mtu=int(dev.active_mtu),
                               traffic_class=self.tos,
                               flow_label=flow_label(self.src_port, self.dst_port))
        except BaseException:
            self._move("resolve_route_failed")
            raise
        self._move("route_resolved")
        self._event(E.RDMA_CM_EVENT_ROUTE_RESOLVED)

    # ---- listening ----------------------------------------------------------------------

    def listen(self, backlog: int = 0) -> None:
        """``rdma_listen``: take REQs (or SIDR_REQs) for this port on the bound address's
        device, or on every soft device for the wildcard address.

        ``backlog`` is how many connection requests may wait for the application (queued
        CONNECT_REQUEST events not taken with ``rdma_get_cm_event``); <= 0 or more than
        :data:`RDMA_UCM_MAX_BACKLOG` gives that maximum (``ucma_listen``). A REQ beyond
        it is forgotten without an answer, so the peer's CM retransmits it (6.144 s later
        with rdma_cm's timers) and may find room then; a SIDR_REQ beyond it is refused
        (SIDR_REP REJECT): Linux's ucma and cm.c. The CM counts both in
        ``counters['listen_overflow']``."""
        what = "rdma_listen"
        if isinstance(backlog, bool) or not isinstance(backlog, int):
            raise _err(f"{what}: backlog must be an int, not {type(backlog).__name__}",
                       errno.EINVAL)
        if self.state == RdmaCmState.IDLE and not self.destroyed:
            self.bind_addr(None, 0)
        self._check("listen", what)
        if self.src_port == 0:
            raise _err(f"{what}: the id has no port", errno.EINVAL)
        if backlog <= 0 or backlog > RDMA_UCM_MAX_BACKLOG:
            backlog = RDMA_UCM_MAX_BACKLOG
        with self._backlog_lock:  # set before a request can arrive
            self.backlog = self._backlog_left = backlog
        self._move("listen", what)
        try:
            self._listen_on_devices(what)
        except BaseException:
            self._move("listen_failed")
            raise
        if self.src_loopback and self.cdev is not None:
            LOOPBACK.publish(self.ps, self.src_ip, self.src_port, self.cdev.ip)
            self._published = True

    def _listen_on_devices(self, what: str) -> None:
        """Listen on the id's device, or on every soft device (``cma_listen_on_all``)."""
        devs = [self.device] if self.cdev is not None else soft_devices()
        sid = service_id(self.ps, self.src_port)
        cdevs = [self.cdev] if self.cdev is not None else []
        if self.cdev is None:
            for dev in devs:
                cdevs.append(CmaDevice.acquire(dev))
                if not dev.live or dev.progress_thread is None:
                    self.channel.watch(dev)
        for c in cdevs:
            if sid in c.listeners and c.listeners[sid] is not self:
                for c2 in cdevs:
                    if c2 is not self.cdev:
                        c2.release()
                raise _err(f"{what}: port {self.src_port} already has a listener on "
                           f"{c.device.name}", errno.EADDRINUSE)
        self._listen_devs = cdevs
        self._listen_cms: list[tuple[CmaDevice, IbCmId]] = []
        for c in cdevs:
            c.listeners[sid] = self
            try:
                self._listen_cms.append((c, c.service.listen(sid, context=self)))
            except Exception as e:  # the CM has a listener there already
                raise _err(f"{what}: port {self.src_port}: {e}", errno.EADDRINUSE) from None

    def on_request(self, ev: CmEvent, cdev: CmaDevice) -> None:
        """A REQ or SIDR_REQ for our service (device lock held): a new id in CONNECT and
        CONNECT_REQUEST, or a reject as cma.c ``cma_ib_req_handler`` sends one."""
        sidr = ev.type == CmEventType.SIDR_REQ_RECEIVED
        msg = ev.message
        try:
            hdr = CmaHeader.unpack(ev.private_data or b"")
        except CmaError:
            return self._refuse(cdev, ev.cm_id, sidr)
        local = ip_address(cdev.ip)
        if hdr.dst != local or (self.src_ip is not None and hdr.dst != self.local_ip) \
                or hdr.src.is_unspecified or hdr.src.is_multicast:
            return self._refuse(cdev, ev.cm_id, sidr)
        # cma.c cma_check_req_qp_type: a REQ's transport must be the listener's QP type,
        # a SIDR_REQ needs a UD listener
        qp_type = ibv_qp_type.IBV_QPT_UD if sidr else {
            0: ibv_qp_type.IBV_QPT_RC, 1: ibv_qp_type.IBV_QPT_UC}.get(int(msg.transport_type))
        if qp_type is None or (qp_type != self.qp_type and self.ps != RDMA_PS_IB) or \
                (self.ps == RDMA_PS_IB and sidr != self.is_ud):
            return self._refuse(cdev, ev.cm_id, sidr)
        if not self._take_backlog():  # ucma_connect_event_handler: -ENOMEM
            cdev.service.destroy(ev.cm_id, err=-errno.ENOMEM)
            return
        child = RdmaCmId(self.channel, self.ps, qp_type=qp_type)
        child.cdev = cdev.ref()
        child.listen_id = self
        with self._backlog_lock:
            self._unreported.add(child)
        child.src_ip, child.src_port = local, self.src_port
        child.dst_ip, child.dst_port = hdr.src, hdr.sport
        child.cm = ev.cm_id
        ev.cm_id.context = child
        child._move("conn_request")
        user = bytes((ev.private_data or b"")[36:])
        if sidr:
            child.route = Route(sgid=gid_from_ip(local), dgid=gid_from_ip(hdr.src),
                                sgid_index=1, path_mtu=int(cdev.device.active_mtu))
            self._event(E.RDMA_CM_EVENT_CONNECT_REQUEST, cid=child, listen_id=self,
                        ud=UdParams(private_data=user.ljust(SIDR_REQ_PRIVATE_DATA, b"\0")))
            return
        dev = cdev.device
        child.req = msg
        child.route = Route(
            sgid=bytes(msg.primary_remote_gid), dgid=bytes(msg.primary_local_gid),
            sgid_index=1, path_mtu=min(int(msg.path_mtu), int(dev.active_mtu)),
            hop_limit=int(msg.primary_hop_limit), traffic_class=int(msg.primary_traffic_class),
            flow_label=int(msg.primary_flow_label),
            packet_life_time=max(int(msg.primary_local_ack_timeout) - 1, 0))
        if child.route.sgid in dev.gid_table:
            child.route.sgid_index = dev.gid_table.index(child.route.sgid)
        child.remote_qpn = int(msg.local_qpn)
        child.sq_psn = int(msg.starting_psn)
        child.retry_count = int(msg.retry_count)
        # librdmacm ucma_process_conn_req: the peer's offer, capped by the device
        child.initiator_depth = min(int(msg.responder_resources), cdev.max_initiator_depth)
        child.responder_resources = min(int(msg.initiator_depth),
                                        cdev.max_responder_resources)
        self._event(E.RDMA_CM_EVENT_CONNECT_REQUEST, cid=child, listen_id=self,
                    conn=ConnParams(
                        private_data=user.ljust(REQ_PRIVATE_DATA, b"\0"),
                        responder_resources=int(msg.initiator_depth),
                        initiator_depth=int(msg.responder_resources),
                        flow_control=int(msg.flow_control), retry_count=int(msg.retry_count),
                        rnr_retry_count=int(msg.rnr_retry_count), srq=int(msg.srq),
                        qp_num=int(msg.local_qpn)))
        # cma_ib_req_handler: the MRA once the request is queued, so a request dropped
        # for want of room has had no answer at all
        if child.state == RdmaCmState.CONNECT and ev.cm_id.state == CmState.REQ_RCVD:
            cdev.service.send_mra(ev.cm_id, CMA_CM_MRA_SETTING)

    def _take_backlog(self) -> bool:
        """Room for one more connection request (``atomic_add_unless(&backlog, -1, 0)``);
        False when the backlog is full."""
        with self._backlog_lock:
            if self._backlog_left <= 0:
                return False
            self._backlog_left -= 1
            return True

    def connect_request_taken(self, child: "RdmaCmId") -> None:
        """The application took the CONNECT_REQUEST event of ``child``, one of this
        listener's (the event channel calls it from ``rdma_get_cm_event``): room for one
        more request (``ucma_get_event``), and the child is the application's now."""
        with self._backlog_lock:
            self._backlog_left += 1
            self._unreported.discard(child)

    @staticmethod
    def _refuse(cdev: CmaDevice, cm_id: IbCmId, sidr: bool) -> None:
        """cma.c: a request rdma_cm cannot take gets REJ 28 (SIDR_REP REJECT), and the
        CM id goes (``cm_destroy_id`` sends exactly these for REQ_RCVD/SIDR_REQ_RCVD)."""
        cdev.service.destroy(cm_id)

    # ---- QP -----------------------------------------------------------------------------

    def attach_qp(self, qp: Any) -> None:
        """``rdma_create_qp``'s second half: the QP becomes the id's and goes to INIT
        (UD: on to RTS at once, with rdma_cm's Q_Key), as librdmacm does."""
        if self.qp is not None:
            raise _err("rdma_create_qp: the id already has a QP", errno.EINVAL)
        if self.cdev is None:
            raise _err("rdma_create_qp: the id is not bound to a device (resolve the "
                       "address or bind a local one first)", errno.EINVAL)
        if qp.device is not self.device:
            raise _err("rdma_create_qp: the QP belongs to another device", errno.EINVAL)
        self.qp = qp
        if qp.qp_type == ibv_qp_type.IBV_QPT_UD:
            self.qp_type = ibv_qp_type.IBV_QPT_UD
        try:
            self._modify_qp("INIT")
            if self.is_ud:
                self._modify_qp("RTR")
                self._modify_qp("RTS")
        except Exception:
            self.qp = None
            raise

    def init_qp_attr(self, state: str) -> tuple[Any, int]:
        """``rdma_init_qp_attr``: the attributes and mask for moving this id's QP to
        ``state`` ("INIT", "RTR" or "RTS"), as the kernel computes them
        (cma.c / cm.c ``cm_init_qp_*_attr``)."""
        a = QPAttr()
        if state == "INIT":
            a.qp_state = Q.IBV_QPS_INIT
            a.pkey_index, a.port_num = 0, 1
            mask = M.IBV_QP_STATE | M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT
            if self.is_ud:
                a.qkey = RDMA_UDP_QKEY
                return a, mask | M.IBV_QP_QKEY
            a.qp_access_flags = 0
            if self.cm is not None:  # ib_cm_init_qp_attr: connected (or connecting)
                a.qp_access_flags = A.IBV_ACCESS_REMOTE_WRITE
                if self.responder_resources:
                    a.qp_access_flags |= A.IBV_ACCESS_REMOTE_READ | \
                        A.IBV_ACCESS_REMOTE_ATOMIC
            return a, mask | M.IBV_QP_ACCESS_FLAGS
        if self.is_ud:
            if state == "RTR":
                a.qp_state = Q.IBV_QPS_RTR
                return a, M.IBV_QP_STATE
            a.qp_state, a.sq_psn = Q.IBV_QPS_RTS, 0
            return a, M.IBV_QP_STATE | M.IBV_QP_SQ_PSN
        if self.cm is None or self.route is None or not self.remote_qpn:
            raise _err(f"rdma_init_qp_attr: {state} needs a connection in progress",
                       errno.EINVAL)
        r = self.route
        if state == "RTR":
            a.qp_state = Q.IBV_QPS_RTR
            a.ah_attr = AHAttr(is_global=1, port_num=1, gr=GlobalRoute(
                dgid=GID(r.dgid), flow_label=r.flow_label, sgid_index=r.sgid_index,
                hop_limit=r.hop_limit, traffic_class=r.traffic_class))
            a.path_mtu = r.path_mtu
            a.dest_qp_num = self.remote_qpn
            a.rq_psn = self.seq_num
            mask = (M.IBV_QP_STATE | M.IBV_QP_AV | M.IBV_QP_PATH_MTU | M.IBV_QP_DEST_QPN
                    | M.IBV_QP_RQ_PSN)
            if self.qp_type == ibv_qp_type.IBV_QPT_RC:
                a.max_dest_rd_atomic = self.responder_resources
                a.min_rnr_timer = 0
                mask |= M.IBV_QP_MAX_DEST_RD_ATOMIC | M.IBV_QP_MIN_RNR_TIMER
            return a, mask
        if state == "RTS":
            a.qp_state = Q.IBV_QPS_RTS
            a.sq_psn = self.sq_psn
            mask = M.IBV_QP_STATE | M.IBV_QP_SQ_PSN
            if self.qp_type == ibv_qp_type.IBV_QPT_RC:
                a.timeout = self.ack_timeout if self.ack_timeout is not None else \
                    self._av_timeout()
                a.retry_cnt = self.retry_count
                a.rnr_retry = self._rnr_retry()
                a.max_rd_atomic = self.initiator_depth
                mask |= (M.IBV_QP_TIMEOUT | M.IBV_QP_RETRY_CNT | M.IBV_QP_RNR_RETRY
                         | M.IBV_QP_MAX_QP_RD_ATOMIC)
            return a, mask
        raise _err(f"rdma_init_qp_attr: state {state!r} is not INIT, RTR or RTS",
                   errno.EINVAL)

    @property
    def path_ack_timeout(self) -> int:
        """The local ACK timeout exponent of the connection's path: the CM REQ's
        ``primary_local_ack_timeout`` where one was received (passive side), the route's
        packet lifetime + 1 otherwise (active side; what cm.c gives the QP); 0 before
        either is known."""
        if self.req is not None:
            return int(self.req.primary_local_ack_timeout)
        return self.route.packet_life_time + 1 if self.route is not None else 0

    def _av_timeout(self) -> int:
        """The QP's ACK timeout: the REQ's local ACK timeout on the passive side, the
        path's packet lifetime + 1 on the active side (cm.c ``cm_init_av_by_path``)."""
        if self.listen_id is not None and self.req is not None:
            return int(self.req.primary_local_ack_timeout)
        return (self.route.packet_life_time if self.route else CMA_IBOE_PACKET_LIFETIME) + 1

    def _rnr_retry(self) -> int:
        if self.listen_id is not None:  # passive: the REQ says how often we may retry
            return int(self.req.rnr_retry_count) if self.req is not None else 7
        return int(self.rep.rnr_retry_count) if self.rep is not None else 7

    def _modify_qp(self, state: str) -> None:
        attr, mask = self.init_qp_attr(state)
        self.qp.modify(attr, mask)

    def _qp_to_rts(self, resp_res: int | None = None, init_depth: int | None = None) -> None:
        """librdmacm ``ucma_modify_qp_rtr`` then ``ucma_modify_qp_rts``: INIT again
        (the access flags now that the connection is known), RTR, RTS."""
        if self.qp is None:
            return
        if self.qp.state in (Q.IBV_QPS_RESET, Q.IBV_QPS_INIT):
            self._modify_qp("INIT")
        self._modify_qp("RTR")
        self._modify_qp("RTS")

    def _qp_to_error(self) -> None:
        if self.qp is None or getattr(self.qp, "closed", False):
            return
        try:
            self.qp.modify(QPAttr(qp_state=Q.IBV_QPS_ERR), M.IBV_QP_STATE)
        except PyverbsRDMAError:
            pass

    # ---- connecting ---------------------------------------------------------------------

    def connect(self, param: ConnParams | None = None) -> None:
        """``rdma_connect``: a REQ (RC/UC) or a SIDR_REQ (UD) to the resolved address."""
        what = "rdma_connect"
        self._check("connect", what)
        cdev = self.cdev
        assert cdev is not None and self.route is not None
        self._loopback_peer()
        if self.is_ud:
            return self._connect_ud(param)
        if self.qp is None and param is None:
            raise _err(f"{what}: without a QP, connection parameters (qp_num) are "
                       f"required", errno.EINVAL)
        self._check_resources(param, what)
        p = param or ConnParams()
        user = _check_private(p.private_data, REQ_PRIVATE_DATA, what)
        self.initiator_depth = cdev.max_initiator_depth if param is None or \
            p.initiator_depth == RDMA_MAX_INIT_DEPTH else p.initiator_depth
        self.responder_resources = cdev.max_responder_resources if param is None or \
            p.responder_resources == RDMA_MAX_RESP_RES else p.responder_resources
        retry = 7 if param is None else min(7, p.retry_count)
        rnr = 7 if param is None else min(7, p.rnr_retry_count)
        qpn = self.qp.qp_num if self.qp is not None else p.qp_num
        srq = int(self.qp.srq is not None) if self.qp is not None else p.srq
        self.retry_count = retry
        hdr = CmaHeader(src=self.local_ip, dst=self.dst_ip, sport=self.src_port)
        r = self.route
        with self._lock(), self._connecting(what):
            self.cm = cdev.service.connect(
                str(self.dst_ip),
                service_id=service_id(self.ps, self.dst_port), local_qpn=qpn,
                starting_psn=self.seq_num, private_data=hdr.pack() + user, context=self,
                packet_life_time=r.packet_life_time,
                remote_cm_response_timeout=CMA_CM_RESPONSE_TIMEOUT,
                local_cm_response_timeout=CMA_CM_RESPONSE_TIMEOUT,
                max_cm_retries=CMA_MAX_CM_RETRIES,
                responder_resources=self.responder_resources,
                initiator_depth=self.initiator_depth,
                transport_type=1 if self.qp_type == ibv_qp_type.IBV_QPT_UC else 0,
                flow_control=int(bool(p.flow_control)),
                retry_count=retry, rnr_retry_count=rnr, srq=srq, path_mtu=r.path_mtu,
                primary_local_gid=r.sgid, primary_remote_gid=r.dgid,
                primary_flow_label=r.flow_label, primary_traffic_class=r.traffic_class,
                primary_hop_limit=r.hop_limit, primary_packet_rate=r.rate)

    @contextmanager
    def _connecting(self, what: str) -> Iterator[None]:
        """``rdma_connect_locked``: CONNECT before the REQ goes (on loopback the answer
        may come before the send returns), back to ROUTE_RESOLVED if it cannot go."""
        self._move("connect", what)
        try:
            yield
        except BaseException:
            if self._can("connect_failed"):
                self._move("connect_failed")
            raise

    def _check_resources(self, param: ConnParams | None, what: str) -> None:
        """librdmacm ``ucma_valid_param``."""
        if self.ps != RDMA_PS_TCP or param is None:
            return
        cdev = self.cdev
        if param.responder_resources != RDMA_MAX_RESP_RES and \
                param.responder_resources > cdev.max_responder_resources:
            raise _err(f"{what}: responder_resources {param.responder_resources} exceeds "
                       f"the device's {cdev.max_responder_resources}", errno.EINVAL)
        if param.initiator_depth != RDMA_MAX_INIT_DEPTH and \
                param.initiator_depth > cdev.max_initiator_depth:
            raise _err(f"{what}: initiator_depth {param.initiator_depth} exceeds the "
                       f"device's {cdev.max_initiator_depth}", errno.EINVAL)

    def _connect_ud(self, param: ConnParams | None) -> None:
        what = "rdma_connect"
        user = _check_private(param.private_data if param else b"", SIDR_REQ_PRIVATE_DATA,
                              what)
        hdr = CmaHeader(src=self.local_ip, dst=self.dst_ip, sport=self.src_port)
        with self._lock(), self._connecting(what):
            self.cm = self.cdev.service.sidr_request(
                str(self.dst_ip), service_id=service_id(self.ps, self.dst_port),
                private_data=hdr.pack() + user, context=self)

    def accept(self, param: ConnParams | None = None) -> None:
        """``rdma_accept`` on a connection request: the QP to RTR and RTS, then the REP
        (UD: the SIDR_REP with the QP's number and rdma_cm's Q_Key)."""
        what = "rdma_accept"
        self._require(what, RdmaCmState.CONNECT)
        cdev = self.cdev
        if self.listen_id is None:  # the active side: rdma_accept after CONNECT_RESPONSE
            return self.establish()
        if self.is_ud:
            user = _check_private(param.private_data if param else b"",
                                  SIDR_REP_PRIVATE_DATA, what)
            qpn = self.qp.qp_num if self.qp is not None else (param.qp_num if param else 0)
            with self._lock():
                cdev.service.sidr_reply(self.cm, status=int(SidrStatus.SUCCESS), qpn=qpn,
                                        qkey=RDMA_UDP_QKEY, private_data=user)
            return
        if self.qp is None and param is None:
            raise _err(f"{what}: without a QP, connection parameters (qp_num) are "
                       f"required", errno.EINVAL)
        self._check_resources(param, what)
        user = _check_private(param.private_data if param else b"", REP_PRIVATE_DATA, what)
        if param is not None and param.initiator_depth != RDMA_MAX_INIT_DEPTH:
            self.initiator_depth = param.initiator_depth
        if param is not None and param.responder_resources != RDMA_MAX_RESP_RES:
            self.responder_resources = param.responder_resources
        with self._lock():
            if self.cm is None or self.cm.state not in (CmState.REQ_RCVD,
                                                        CmState.MRA_REQ_SENT):
                raise _err(f"{what}: the request is no longer pending", errno.EINVAL)
            try:
                self._qp_to_rts()
            except PyverbsRDMAError:
                self._qp_to_error()
                raise
            qpn = self.qp.qp_num if self.qp is not None else param.qp_num
            srq = int(self.qp.srq is not None) if self.qp is not None else param.srq
            rnr = 7 if param is None else min(7, param.rnr_retry_count)
            cdev.service.accept(
                self.cm, local_qpn=qpn, starting_psn=self.seq_num, private_data=user,
                responder_resources=self.responder_resources,
                initiator_depth=self.initiator_depth,
                flow_control=int(bool(param.flow_control)) if param else 0,
                rnr_retry_count=rnr, srq=srq)

    def establish(self) -> None:
        """``rdma_establish`` (active side, no QP, after CONNECT_RESPONSE): send the RTU.
        On the passive side: the peer's first data came before the RTU (``rdma_notify``)."""
        what = "rdma_establish"
        self._require(what, RdmaCmState.CONNECT)
        with self._lock():
            cm = self.cm
            if cm is None:
                raise _err(f"{what}: no connection in progress", errno.EINVAL)
            if cm.state in (CmState.REP_RCVD, CmState.MRA_REP_SENT):
                self.cdev.service.ready_to_use(cm)
            elif cm.state in (CmState.REP_SENT, CmState.MRA_REP_RCVD):
                self.cdev.service.establish(cm)
            else:
                raise _err(f"{what}: the connection is {cm.state.name}", errno.EINVAL)

    def reject(self, private_data: bytes = b"",
               reason: int = RejectReason.CONSUMER_DEFINED) -> None:
        """``rdma_reject``: REJ 28 (consumer defined; ``rdma_reject_ece`` gives 35, vendor
        option not supported) with up to 148 bytes of private data; for UD a SIDR_REP
        with status REJECT."""
        what = "rdma_reject"
        self._require(what, RdmaCmState.CONNECT)
        if self.listen_id is None and not (self.cm and self.cm.state in (
                CmState.REP_RCVD, CmState.MRA_REP_SENT)):
            raise _err(f"{what}: not a connection request", errno.EINVAL)
        data = _check_private(private_data, SIDR_REP_PRIVATE_DATA if self.is_ud
                              else REJ_PRIVATE_DATA, what)
        with self._lock():
            try:
                if self.is_ud:
                    self.cdev.service.sidr_reply(self.cm, status=int(SidrStatus.REJECT),
                                                 private_data=data)
                else:
                    self.cdev.service.reject(self.cm, reason, data)
            except CmStateError:
                # the peer's REJ (or a timeout) ended the request first: ib_send_cm_rej's
                # -EINVAL, not an exception from the CM's insides
                raise _err(f"{what}: the request is no longer pending", errno.EINVAL) from None

    def disconnect(self) -> None:
        """``rdma_disconnect``: the QP to ERROR, then a DREQ (or, if the peer's DREQ came
        first, the DREP)."""
        what = "rdma_disconnect"
        if self.destroyed:
            raise _err(f"{what}: the id is destroyed", errno.EBADF)
        if self.cm is None or self.state not in (RdmaCmState.CONNECT,
                                                 RdmaCmState.DISCONNECT):
            raise _err(f"{what}: the id is not connected ({self.state.name})", errno.EINVAL)
        with self._lock():
            self._qp_to_error()
            cm = self.cm
            if cm.state == CmState.ESTABLISHED:  # cm.c sends a DREQ only when established
                self.cdev.service.disconnect(cm)
            elif cm.state == CmState.DREQ_RCVD:
                self.cdev.service.disconnect_reply(cm)

    # ---- CM events (device lock held) ---------------------------------------------------

    def on_cm_event(self, ev: CmEvent) -> None:
        """An event of an IB CM id this id made (device lock held; :class:`CmaDevice`
        calls it): cma.c ``cma_ib_handler`` / ``cma_sidr_rep_handler`` and librdmacm's
        event processing."""
        if self.cm is None:  # the answer came before connect() returned (loopback)
            self.cm = ev.cm_id
        if self.cm is not ev.cm_id:
            return
        t = ev.type
        T = CmEventType
        if t == T.TIMEWAIT_EXIT:
            if self.state == RdmaCmState.DISCONNECT:
                self._event(E.RDMA_CM_EVENT_TIMEWAIT_EXIT)
            return
        if t == T.SIDR_REP_RECEIVED:
            return self._on_sidr_rep(ev)
        if t == T.SIDR_REQ_ERROR:
            self._event(E.RDMA_CM_EVENT_UNREACHABLE, status=-ETIMEDOUT)
            return
        if self.state != RdmaCmState.CONNECT or t == T.MRA_RECEIVED:
            return  # cma_ib_handler: only a connecting id listens; MRAs are swallowed
        if t in (T.REQ_ERROR, T.REP_ERROR):
            self._event(E.RDMA_CM_EVENT_UNREACHABLE, status=-ETIMEDOUT)
        elif t == T.REP_RECEIVED:
            self._on_rep(ev)
        elif t in (T.RTU_RECEIVED, T.USER_ESTABLISHED):
            self._event(E.RDMA_CM_EVENT_ESTABLISHED, conn=ConnParams())
        elif t in (T.DREQ_ERROR, T.DREQ_RECEIVED, T.DREP_RECEIVED):
            self._move("disconnected")
            self._event(E.RDMA_CM_EVENT_DISCONNECTED,
                        status=-ETIMEDOUT if t == T.DREQ_ERROR else 0)
        elif t == T.REJ_RECEIVED:
            self._qp_to_error()
            self._event(E.RDMA_CM_EVENT_REJECTED, status=int(ev.reason or 0),
                        conn=ConnParams(private_data=bytes(ev.private_data or b"").ljust(
                            REJ_PRIVATE_DATA, b"\0")[:REJ_PRIVATE_DATA]))

    def _on_rep(self, ev: CmEvent) -> None:
        msg = ev.message
        self.rep = msg
        self.remote_qpn = int(msg.local_qpn)
        self.sq_psn = int(msg.starting_psn)
        # cm_rep_handler: the peer's resources are our depth, and the other way round
        self.initiator_depth = int(msg.responder_resources)
        self.responder_resources = int(msg.initiator_depth)
        self.cdev.service.send_mra(self.cm, CMA_CM_MRA_SETTING)
        conn = ConnParams(private_data=bytes(ev.private_data or b"")[:REP_PRIVATE_DATA],
                          responder_resources=int(msg.initiator_depth),
                          initiator_depth=int(msg.responder_resources),
                          flow_control=int(msg.flow_control),
                          rnr_retry_count=int(msg.rnr_retry_count), srq=int(msg.srq),
                          qp_num=int(msg.local_qpn))
        if self.qp is None:
            self._event(E.RDMA_CM_EVENT_CONNECT_RESPONSE, conn=conn)
            return
        try:  # librdmacm ucma_process_conn_resp
            self._qp_to_rts()
        except PyverbsRDMAError as e:
            self._qp_to_error()
            self.connect_error = True
            self._event(E.RDMA_CM_EVENT_CONNECT_ERROR, status=-(e.error_code or errno.EINVAL),
                        conn=conn)
            return
        self.cdev.service.ready_to_use(self.cm)
        self._event(E.RDMA_CM_EVENT_ESTABLISHED, conn=conn)

    def _on_sidr_rep(self, ev: CmEvent) -> None:
        """cma.c ``cma_sidr_rep_handler``: status 0 is ESTABLISHED with the service's
        QPN, Q_Key and an address to reach it; anything else UNREACHABLE."""
        msg = ev.message
        if self.state != RdmaCmState.CONNECT:
            return
        data = bytes(ev.private_data or b"")[:SIDR_REP_PRIVATE_DATA]
        if int(msg.status) != SidrStatus.SUCCESS:
            self._event(E.RDMA_CM_EVENT_UNREACHABLE, status=int(msg.status),
                        ud=UdParams(private_data=data))
            return
        if int(msg.qkey) != RDMA_UDP_QKEY:  # cma_set_qkey's check on the reply
            self._event(E.RDMA_CM_EVENT_UNREACHABLE, status=-errno.EINVAL,
                        ud=UdParams(private_data=data))
            return
        r = self.route
        ah = AHAttr(is_global=1, port_num=1, gr=GlobalRoute(
            dgid=GID(r.dgid), flow_label=r.flow_label, sgid_index=r.sgid_index,
            hop_limit=r.hop_limit, traffic_class=r.traffic_class))
        self.remote_qpn, self.remote_qkey = int(msg.qpn), int(msg.qkey)
        self._event(E.RDMA_CM_EVENT_ESTABLISHED,
                    ud=UdParams(private_data=data, ah_attr=ah, qp_num=int(msg.qpn),
                                qkey=int(msg.qkey)))

    # ---- multicast ----------------------------------------------------------------------

    def join_multicast(self, addr: Any, context: Any = None,
                       join_flags: int = RDMA_MC_JOIN_FLAG_FULLMEMBER) -> None:
        """``rdma_join_multicast_ex`` on RoCEv2 (cma.c ``cma_iboe_join_multicast``): no SA
        to ask, so the join is answered at once with RDMA_CM_EVENT_MULTICAST_JOIN whose
        UD parameters reach the group: ``ah_attr`` with the group's GID (an IPv4 group
        as ``::ffff:a.b.c.d``) as dgid, hop limit 64, ``qp_num`` 0xFFFFFF, ``qkey``
        RDMA_UDP_QKEY (port space UDP; 0 otherwise), ``private_data`` empty and the
        event's context ``context``. A full member's QP is attached to the group, as
        librdmacm's ``ucma_process_join`` does when the event arrives (a send-only member's
        is not). EINVAL unless the id is bound or resolved to a device (ADDR_BOUND or
        ADDR_RESOLVED), or ``addr`` is not a multicast address; an IPv6 group fails at once
        with ENOTSUPP (524), as the kernel's join answers on RoCEv2 (no event)."""
        what = "rdma_join_multicast"
        if self.destroyed:
            raise _err(f"{what}: the id is destroyed", errno.EBADF)
        maddr = parse_ip(addr, what)
        if maddr is None or not maddr.is_multicast:
            raise _err(f"{what}: {addr} is not a multicast address", errno.EINVAL)
        if self.cdev is None or self.state not in (RdmaCmState.ADDR_BOUND,
                                                   RdmaCmState.ADDR_RESOLVED):
            raise _err(f"{what}: the id must be bound or resolved to a device first "
                       f"(state {self.state.name})", errno.EINVAL)
        if join_flags not in (RDMA_MC_JOIN_FLAG_FULLMEMBER,
                              RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER):
            raise _err(f"{what}: unknown join flags {join_flags}", errno.EINVAL)
        if maddr.version == 6:  # cma_iboe_join_multicast: no IPv6 groups on RoCEv2
            raise _err(f"{what}: IPv6 groups are not supported on RoCEv2 (the kernel's "
                       f"ENOTSUPP)", ENOTSUPP)
        mgid = gid_from_ip(maddr)
        dev = self.device
        own = gid_from_ip(self.local_ip) if self.local_ip is not None else dev.gid_table[-1]
        sgid_index = dev.gid_table.index(own) if own in dev.gid_table else 1
        ah = AHAttr(is_global=1, port_num=1, dlid=0, sl=0, gr=GlobalRoute(
            dgid=GID(mgid), sgid_index=sgid_index, hop_limit=IPV6_DEFAULT_HOPLIMIT))
        if self.qp is not None and join_flags == RDMA_MC_JOIN_FLAG_FULLMEMBER:
            self.qp.attach_mcast(mgid, 0)
        self.mcast.insert(0, (maddr, mgid, join_flags))  # a second join is a second entry
        qkey = RDMA_UDP_QKEY if self.ps == RDMA_PS_UDP else 0
        self._event(E.RDMA_CM_EVENT_MULTICAST_JOIN,
                    ud=UdParams(ah_attr=ah, qp_num=MULTICAST_QPN, qkey=qkey, context=context))

    def leave_multicast(self, addr: Any) -> None:
        """``rdma_leave_multicast``: the QP is detached (a full member's) and the group
        forgotten (the newest join of that address: a group joined twice is two entries, as
        in librdmacm's list); EADDRNOTAVAIL for a group this id has not joined."""
        what = "rdma_leave_multicast"
        maddr = parse_ip(addr, what)
        joined = next((j for j in self.mcast if j[0] == maddr), None)
        if maddr is None or joined is None:
            raise _err(f"{what}: {addr} was not joined", errno.EADDRNOTAVAIL)
        self.mcast.remove(joined)
        _, mgid, flags = joined
        if self.qp is not None and flags == RDMA_MC_JOIN_FLAG_FULLMEMBER and \
                not getattr(self.qp, "closed", False):
            try:
                self.qp.detach_mcast(mgid, 0)
            except PyverbsRDMAError:
                pass  # the QP was detached some other way: the group is left all the same

    # ---- the end ------------------------------------------------------------------------

    def destroy(self) -> None:
        """``rdma_destroy_id``: leave the CM as Linux does (REJ, DREQ or DREP for the
        connection's state), stop listening, free the port. Idempotent."""
        if self.destroyed:
            return
        cdev = self.cdev
        if self._published:
            LOOPBACK.withdraw(self.ps, self.src_ip, self.src_port)
            self._published = False
        if self.state == RdmaCmState.LISTEN:
            sid = service_id(self.ps, self.src_port)
            for c, cm in getattr(self, "_listen_cms", ()):
                c.service.destroy(cm)
            for c in getattr(self, "_listen_devs", ()):
                with c.device.lock:
                    if c.listeners.get(sid) is self:
                        del c.listeners[sid]
                if c is not cdev:
                    c.release()
            # ucma_cleanup_ctx_events: the requests nobody took go with their listener
            # (each child is rejected as rdma_destroy_id does: REJ 28, SIDR_REP REJECT)
            with self._backlog_lock:
                unreported, self._unreported = self._unreported, set()
            for child in unreported:
                child.destroy()
        if self.cm is not None and cdev is not None:
            with self._lock():
                if self.is_ud and self.cm.state == CmState.SIDR_REQ_RCVD:
                    cdev.service.sidr_reply(self.cm, status=int(SidrStatus.REJECT))
                if self.cm.context is self:
                    self.cm.context = None
                if cdev.service.holds(self.cm):
                    cdev.service.destroy(self.cm)
        self.destroyed = True
        self._move("destroy")
        self.channel.ids.discard(self)
        PORTS.unbind(self)
        if cdev is not None:
            self.cdev = None
            cdev.release()

