"""librdmacm's connection calls and the id's odds and ends: ``rdma_listen``,
``rdma_get_request``, ``rdma_connect``, ``rdma_accept``, ``rdma_reject``/``_ece``,
``rdma_establish``, ``rdma_notify``, ``rdma_disconnect``; ``rdma_set_option``, the ports,
``rdma_get_devices``, ECE, multicast.

Each is librdmacm's (rdma-core 44, ``librdmacm/cma.c``) over softrdma's rdma_cm id, with
the structures :mod:`.cma` keeps: a synchronous id waits for the call's outcome
(``ucma_complete``); the QP the CM moves is the id's own (``rdma_create_qp``,
:mod:`.cma_qp`).

* ``rdma_connect`` sends ``rdma_addrinfo``'s ``ai_connect`` ahead of the program's private
  data; ``rdma_accept`` and ``rdma_connect`` without a QP need ``conn_param`` (qp_num).
* ``rdma_reject`` sends REJ reason 28 (consumer defined), ``rdma_reject_ece`` 35 (vendor
  option not supported), as the kernel's ``ucma_reject``.
* ``rdma_notify`` is ``IBV_EVENT_COMM_EST`` only (the peer's data came before the RTU).
* ``rdma_set_option``: RDMA_OPTION_ID's TOS, REUSEADDR, AFONLY, ACK_TIMEOUT with the
  kernel's size and state checks; ENOSYS for what the kernel does not know.
* ECE: rxe has none (``ibv_query_ece`` is EOPNOTSUPP there), so the peer's is all zeros;
  ``rdma_set_local_ece`` keeps what the program sets, with librdmacm's checks.
* Multicast: the RoCEv2 join (no SA: MULTICAST_JOIN at once, the id's QP attached to the
  group, softrdma.soft.mcast); an AF_IB group (``mckey -M``) is ENOTSUPP (524), as the
  kernel answers on RoCEv2.
"""

from __future__ import annotations

import errno
from typing import Any

from .cma import ConnParams, E, IBV_QPT_RC, SOCKADDR_STORAGE, route_addr, cm_call, cma_dev, \
    complete, conn_param, get_event, id_of, query_route, sync_qp_state
from ..errors import PyverbsRDMAError
from .cma_addr import read_sockaddr, sockaddr_len, sockaddr_port
from .shim import Errno, handles

__all__ = ["IMPLEMENTS", "install"]

RDMA_OPTION_ID, RDMA_OPTION_IB = 0, 1
RDMA_OPTION_ID_TOS, RDMA_OPTION_ID_REUSEADDR = 0, 1
RDMA_OPTION_ID_AFONLY, RDMA_OPTION_ID_ACK_TIMEOUT = 2, 3
IBV_EVENT_COMM_EST = 4
AF_IB = 27  # an InfiniBand address (mckey -M)
ENOTSUPP = 524  # the kernel's "not supported" (not EOPNOTSUPP), as rdma_cm answers
#: IBTA's reject reasons: rdma_reject's (consumer defined) and rdma_reject_ece's
REJ_CONSUMER_DEFINED, REJ_VENDOR_OPTION_NOT_SUPPORTED = 28, 35

IMPLEMENTS = (
    "rdma_listen", "rdma_get_request", "rdma_accept", "rdma_reject", "rdma_reject_ece",
    "rdma_connect", "rdma_establish", "rdma_disconnect", "rdma_notify", "rdma_set_option",
    "rdma_get_src_port", "rdma_get_dst_port", "rdma_get_devices", "rdma_free_devices",
    "rdma_set_local_ece", "rdma_get_remote_ece", "rdma_join_multicast",
    "rdma_join_multicast_ex", "rdma_leave_multicast",
)


def install(ffi: Any, lib: Any) -> None:
    """Define this part's functions (after :mod:`.cma`'s, whose structures they use)."""

    @ffi.def_extern(name="rdma_listen")
    @cm_call(-1)
    def rdma_listen(id: Any, backlog: int) -> int:
        rec = id_of(id)
        rec.cid.listen(backlog)
        query_route(rec)
        return 0

    @ffi.def_extern(name="rdma_get_request")
    @cm_call(-1)
    def rdma_get_request(listen: Any, id_out: Any) -> int:
        rec = id_of(listen)
        if not rec.sync or id_out == ffi.NULL:
            raise Errno(errno.EINVAL, "rdma_get_request: not a synchronous listener")
        rec.set_event(None)
        ev = get_event(rec.channel, True)
        s = ev.struct
        if s.event == E.RDMA_CM_EVENT_REJECTED or s.status or \
                s.event != E.RDMA_CM_EVENT_CONNECT_REQUEST:
            rec.set_event(ev)
            code = errno.ECONNREFUSED if s.event == E.RDMA_CM_EVENT_REJECTED else \
                (abs(s.status) or errno.EINVAL)
            raise Errno(code, f"rdma_get_request: {E(s.event).name}")
        if rec.qp_init_attr is not None:
            from .cma_qp import create_qp_for_request
            try:
                create_qp_for_request(ev.rec, rec)
            except BaseException:
                rec.set_event(ev)
                raise
        id_out[0] = s.id
        ev.rec.set_event(ev)
        return 0

    @ffi.def_extern(name="rdma_connect")
    @cm_call(-1)
    def rdma_connect(id: Any, param: Any) -> int:
        rec = id_of(id)
        p = conn_param(param)
        if rec.connect:  # rdma_addrinfo's ai_connect goes first (ucma_copy_conn_param)
            p = p or ConnParams(responder_resources=0xFF, initiator_depth=0xFF,
                                retry_count=7, rnr_retry_count=7)
            p.private_data = rec.connect + p.private_data
            rec.connect = b""
        rec.cid.connect(p)
        complete(rec)
        return 0

    @ffi.def_extern(name="rdma_accept")
    @cm_call(-1)
    def rdma_accept(id: Any, param: Any) -> int:
        rec = id_of(id)
        p = conn_param(param)
        if rec.struct.qp == ffi.NULL and p is None:
            raise Errno(errno.EINVAL, "rdma_accept: no QP and no conn_param")
        rec.cid.accept(p)
        sync_qp_state(rec)
        if not rec.cid.is_ud:
            complete(rec)
        return 0

    def reject(id: Any, data: Any, length: int, reason: int) -> int:
        rec = id_of(id)
        pd = bytes(ffi.buffer(ffi.cast("char *", data), length)) \
            if data != ffi.NULL and length else b""
        rec.cid.reject(pd, reason=reason)
        return 0

    @ffi.def_extern(name="rdma_reject")
    @cm_call(-1)
    def rdma_reject(id: Any, data: Any, length: int) -> int:
        return reject(id, data, length, REJ_CONSUMER_DEFINED)

    @ffi.def_extern(name="rdma_reject_ece")
    @cm_call(-1)
    def rdma_reject_ece(id: Any, data: Any, length: int) -> int:
        return reject(id, data, length, REJ_VENDOR_OPTION_NOT_SUPPORTED)

    @ffi.def_extern(name="rdma_establish")
    @cm_call(-1)
    def rdma_establish(id: Any) -> int:
        rec = id_of(id)
        if rec.struct.qp != ffi.NULL:
            raise Errno(errno.EINVAL, "rdma_establish: the id has a QP (the CM moved it)")
        rec.cid.establish()
        return 0

    @ffi.def_extern(name="rdma_notify")
    @cm_call(-1)
    def rdma_notify(id: Any, event: int) -> int:
        from ..cm.state import CmState
        rec = id_of(id)
        cm = rec.cid.cm
        if event != IBV_EVENT_COMM_EST or cm is None:
            raise Errno(errno.EINVAL, "rdma_notify: only IBV_EVENT_COMM_EST, on a connection")
        if cm.state == CmState.ESTABLISHED:
            raise Errno(errno.EISCONN, "rdma_notify: already established")
        if cm.state not in (CmState.REP_SENT, CmState.MRA_REP_RCVD):
            raise Errno(errno.EINVAL, f"rdma_notify: the connection is {cm.state.name}")
        rec.cid.establish()
        return 0

    @ffi.def_extern(name="rdma_disconnect")
    @cm_call(-1)
    def rdma_disconnect(id: Any) -> int:
        rec = id_of(id)
        if rec.struct.verbs == ffi.NULL:  # ucma_shutdown
            raise Errno(errno.EINVAL, "rdma_disconnect: the id has no device")
        rec.cid.disconnect()
        sync_qp_state(rec)
        complete(rec)
        return 0

    @ffi.def_extern(name="rdma_set_option")
    @cm_call(-1)
    def rdma_set_option(id: Any, level: int, optname: int, optval: Any, optlen: int) -> int:
        rec = id_of(id)
        cid = rec.cid
        if optval == ffi.NULL:
            raise Errno(errno.EFAULT, "rdma_set_option: optval is NULL")
        if level == RDMA_OPTION_ID:
            size = 1 if optname in (RDMA_OPTION_ID_TOS, RDMA_OPTION_ID_ACK_TIMEOUT) else 4
            if optname > RDMA_OPTION_ID_ACK_TIMEOUT:
                raise Errno(errno.ENOSYS, f"rdma_set_option: option {optname}")
            if optlen != size:
                raise Errno(errno.EINVAL, f"rdma_set_option: optlen {optlen}, not {size}")
            v = ffi.cast("uint8_t *" if size == 1 else "int *", optval)[0]
            if optname == RDMA_OPTION_ID_TOS:
                cid.tos = v
            elif optname == RDMA_OPTION_ID_ACK_TIMEOUT:
                if cid.qp_type != IBV_QPT_RC:  # rdma_set_ack_timeout: RC (XRC) only
                    raise Errno(errno.EINVAL, "rdma_set_option: ACK timeout of a non-RC id")
                cid.ack_timeout = v
            elif optname == RDMA_OPTION_ID_REUSEADDR:
                from ..rdmacm.enums import RdmaCmState as S
                if not (cid.state == S.IDLE or (v and cid.state != S.LISTEN)):
                    raise Errno(errno.EINVAL, "rdma_set_option: REUSEADDR too late")
                cid.reuseaddr = bool(v)
            else:
                from ..rdmacm.enums import RdmaCmState as S
                if cid.state != S.IDLE:
                    raise Errno(errno.EINVAL, "rdma_set_option: AFONLY after bind")
            return 0
        if level == RDMA_OPTION_IB:
            # path records (RDMA_OPTION_IB_PATH) come from ibacm or the SA: RoCE makes
            # its own; the kernel refuses a record before the address is resolved
            raise Errno(errno.EINVAL if optname == 1 else errno.ENOSYS,
                        f"rdma_set_option: IB option {optname}")
        raise Errno(errno.ENOSYS, f"rdma_set_option: level {level}")

    @ffi.def_extern(name="rdma_get_src_port")
    @cm_call(0)
    def rdma_get_src_port(id: Any) -> int:
        return sockaddr_port(route_addr(id_of(id).struct))

    @ffi.def_extern(name="rdma_get_dst_port")
    @cm_call(0)
    def rdma_get_dst_port(id: Any) -> int:
        return sockaddr_port(route_addr(id_of(id).struct) + SOCKADDR_STORAGE)

    @ffi.def_extern(name="rdma_get_devices")
    @cm_call(ffi.NULL)
    def rdma_get_devices(num: Any) -> Any:
        from ..rdmacm.addr import soft_devices
        devs = []
        for d in soft_devices():
            try:
                devs.append(cma_dev(d.name))
            except Errno:
                continue  # ucma_init_device failed: "dead", not listed
        for d in devs:
            d.refcnt += 1
        lst = ffi.new("struct ibv_context *[]", [d.verbs for d in devs] + [ffi.NULL])
        handles.add("cm_devices", lst, devs)
        if num != ffi.NULL:
            num[0] = len(devs)
        return lst

    @ffi.def_extern(name="rdma_free_devices")
    @cm_call(None)
    def rdma_free_devices(lst: Any) -> None:
        for d in handles.release("cm_devices", lst):
            d.refcnt -= 1

    @ffi.def_extern(name="rdma_set_local_ece")
    @cm_call(-1)
    def rdma_set_local_ece(id: Any, ece: Any) -> int:
        rec = id_of(id)
        e = ffi.cast("uint32_t *", ece)  # struct ibv_ece: vendor_id, options, comp_mask
        if rec.struct.qp != ffi.NULL or ece == ffi.NULL or not e[0] or e[2]:
            raise Errno(errno.EINVAL, "rdma_set_local_ece: a QP exists, or a bad ece")
        rec.local_ece = (int(e[0]), int(e[1]))
        return 0

    @ffi.def_extern(name="rdma_get_remote_ece")
    @cm_call(-1)
    def rdma_get_remote_ece(id: Any, ece: Any) -> int:
        rec = id_of(id)
        if rec.struct.qp != ffi.NULL or ece == ffi.NULL:
            raise Errno(errno.EINVAL, "rdma_get_remote_ece: a QP exists, or ece is NULL")
        e = ffi.cast("uint32_t *", ece)
        e[0], e[1], e[2] = rec.remote_ece[0], rec.remote_ece[1], 0
        return 0

    # multicast: the RoCEv2 join of softrdma's rdma_cm (RdmaCmId.join_multicast), which
    # also attaches the id's QP as librdmacm's ucma_process_join does on the event
    def join(id: Any, addr: Any, flags: int, context: Any, what: str) -> int:
        rec = id_of(id)
        if addr != ffi.NULL and ffi.cast("struct sockaddr *", addr).sa_family == AF_IB:
            # an AF_IB (unmapped) group: cma_iboe_join_multicast has none on RoCEv2
            raise Errno(ENOTSUPP, f"{what}: AF_IB groups on RoCEv2")
        if not sockaddr_len(addr):
            raise Errno(errno.EINVAL, f"{what}: not an IP address")
        _, ip, _ = read_sockaddr(addr)
        rec.cid.join_multicast(ip, context, flags)
        complete(rec)
        return 0

    @ffi.def_extern(name="rdma_join_multicast")
    @cm_call(-1)
    def rdma_join_multicast(id: Any, addr: Any, context: Any) -> int:
        return join(id, addr, 0, context, "rdma_join_multicast")

    @ffi.def_extern(name="rdma_join_multicast_ex")
    @cm_call(-1)
    def rdma_join_multicast_ex(id: Any, attr: Any, context: Any) -> int:
        id_of(id)
        if attr == ffi.NULL:
            raise Errno(errno.EINVAL, "rdma_join_multicast_ex: attr is NULL")
        if attr.comp_mask >= 4:  # RDMA_CM_JOIN_MC_ATTR_RESERVED
            raise Errno(errno.EOPNOTSUPP, "rdma_join_multicast_ex: unknown comp_mask")
        if not attr.comp_mask & 1 or not attr.comp_mask & 2 or attr.join_flags >= 2:
            raise Errno(errno.EINVAL, "rdma_join_multicast_ex: bad attributes")
        return join(id, attr.addr, attr.join_flags, context, "rdma_join_multicast_ex")

    @ffi.def_extern(name="rdma_leave_multicast")
    @cm_call(-1)
    def rdma_leave_multicast(id: Any, addr: Any) -> int:
        rec = id_of(id)
        if not sockaddr_len(addr):
            raise Errno(errno.EADDRNOTAVAIL, "rdma_leave_multicast: not a group joined")
        _, ip, _ = read_sockaddr(addr)
        try:
            rec.cid.leave_multicast(ip)
        except PyverbsRDMAError as e:
            raise Errno(e.error_code, str(e)) from None
        return 0

