"""librdmacm's QP side: ``rdma_create_qp``/``_ex``, ``rdma_destroy_qp``, the SRQ calls,
``rdma_init_qp_attr``, and the endpoints (``rdma_create_ep``/``rdma_destroy_ep``).

An id's QP is an ordinary QP of the verbs part (:func:`softrdma.exec.queues.make_qp`: the
program posts to it through ``context->ops`` like any other) and, at the same time, the
QP softrdma's rdma_cm connects: :meth:`RdmaCmId.attach_qp` takes the very same verbs_api
QP, so the CM moves it (INIT now; RTR and RTS with the connection; ERR when it ends) as
librdmacm does with ``ibv_modify_qp``. CQs the program did not give are made for the id,
each with a completion channel of its own (``ucma_create_cqs``: ``id->send_cq``,
``id->recv_cq`` and their channels, ``cq_context`` the id), and go with the QP.

Extended creation attributes that need more than the basic QP (``rdma_create_qp_ex`` with
XRC, TSO, RSS or ``ibv_qp_ex`` send ops; XRC SRQs) fail with EOPNOTSUPP, as on rxe.
"""

from __future__ import annotations

import errno
from typing import Any

from . import cma, queues
from .cma import Id, cm_call, id_of
from .shim import Errno
from .verbs import ah_attr_to_c

__all__ = ["IMPLEMENTS", "install", "create_qp", "destroy_qp", "create_qp_for_request",
           "init_qp_attr", "create_ep", "destroy_ep"]

IMPLEMENTS = ("rdma_create_qp", "rdma_create_qp_ex", "rdma_destroy_qp", "rdma_create_srq",
              "rdma_create_srq_ex", "rdma_destroy_srq", "rdma_init_qp_attr", "rdma_create_ep",
              "rdma_destroy_ep")

RAI_PASSIVE = 1
IBV_QPT_XRC_RECV = 10
#: struct ibv_qp_init_attr_ex and struct ibv_srq_init_attr_ex past the basic structure
#: (verbs.h, x86_64; not declared to cffi here: the extended-verbs part may declare them)
QP_EX_COMP_MASK, QP_EX_PD, QP_EX_CREATE_FLAGS = 60, 64, 80
SRQ_EX_COMP_MASK, SRQ_EX_TYPE, SRQ_EX_PD = 20, 24, 32
QP_INIT_ATTR_PD, QP_INIT_ATTR_CREATE_FLAGS = 1, 4
SRQ_INIT_ATTR_TYPE, SRQ_INIT_ATTR_PD = 1, 2
IBV_SRQT_BASIC = 0

#: rdma_init_qp_attr's states (enum ibv_qp_state) and softrdma's names for them
_STATES = {1: "INIT", 2: "RTR", 3: "RTS"}
#: struct ibv_qp_attr fields rdma_init_qp_attr fills from a verbs_api QPAttr
_FIELDS = ("qp_state", "cur_qp_state", "path_mtu", "path_mig_state", "qkey", "rq_psn",
           "sq_psn", "dest_qp_num", "qp_access_flags", "pkey_index", "port_num",
           "max_rd_atomic", "max_dest_rd_atomic", "min_rnr_timer", "timeout", "retry_cnt",
           "rnr_retry")

ffi: Any = None
lib: Any = None


def _at(ptr: Any, offset: int, ctype: str) -> Any:
    return ffi.cast(ctype + " *", ffi.cast("char *", ptr) + offset)


def _create_cqs(rec: Id, send_size: int, recv_size: int) -> None:
    """``ucma_create_cqs``: a channel and a CQ for each side asked (size > 0)."""
    s = rec.struct
    for side, size in (("recv", recv_size), ("send", send_size)):
        if not size:
            continue
        ch = lib.ibv_create_comp_channel(s.verbs)
        if ch == ffi.NULL:
            raise Errno(ffi.errno or errno.ENOMEM, "rdma_create_qp: no completion channel")
        setattr(s, f"{side}_cq_channel", ch)
        cq = lib.ibv_create_cq(s.verbs, size, ffi.cast("void *", s), ch, 0)
        if cq == ffi.NULL:
            raise Errno(ffi.errno or errno.ENOMEM, "rdma_create_qp: no CQ")
        setattr(s, f"{side}_cq", cq)


def _destroy_cqs(rec: Id) -> None:
    """``ucma_destroy_cqs``: the CQs and channels made for the id."""
    s = rec.struct
    if s.recv_cq != ffi.NULL:
        lib.ibv_destroy_cq(s.recv_cq)
        if s.send_cq != ffi.NULL and s.send_cq != s.recv_cq:
            lib.ibv_destroy_cq(s.send_cq)
            s.send_cq = ffi.NULL
        s.recv_cq = ffi.NULL
    if s.recv_cq_channel != ffi.NULL:
        lib.ibv_destroy_comp_channel(s.recv_cq_channel)
        if s.send_cq_channel != ffi.NULL and s.send_cq_channel != s.recv_cq_channel:
            lib.ibv_destroy_comp_channel(s.send_cq_channel)
            s.send_cq_channel = ffi.NULL
        s.recv_cq_channel = ffi.NULL


def create_qp(rec: Id, pd: Any, attr: Any) -> None:
    """``rdma_create_qp_ex`` for a basic ``struct ibv_qp_init_attr`` (``attr`` gets the
    CQs and SRQ used and the capabilities granted, as the program's copy does)."""
    s = rec.struct
    if s.qp != ffi.NULL:
        raise Errno(errno.EINVAL, "rdma_create_qp: the id has a QP")
    if attr == ffi.NULL:
        raise Errno(errno.EINVAL, "rdma_create_qp: qp_init_attr is NULL")
    if pd == ffi.NULL:
        pd = s.pd
    if pd == ffi.NULL or s.verbs == ffi.NULL:
        raise Errno(errno.EINVAL, "rdma_create_qp: the id has no device yet (bind or "
                                  "resolve an address first)")
    if pd.context != s.verbs:
        raise Errno(errno.EINVAL, "rdma_create_qp: the PD is of another device")
    if (s.recv_cq != ffi.NULL and attr.recv_cq != ffi.NULL and s.recv_cq != attr.recv_cq) or \
            (s.send_cq != ffi.NULL and attr.send_cq != ffi.NULL and s.send_cq != attr.send_cq):
        raise Errno(errno.EINVAL, "rdma_create_qp: CQs other than the id's")
    _create_cqs(rec, 0 if attr.send_cq != ffi.NULL or s.send_cq != ffi.NULL
                else attr.cap.max_send_wr,
                0 if attr.recv_cq != ffi.NULL or s.recv_cq != ffi.NULL
                else attr.cap.max_recv_wr)
    try:
        if attr.send_cq == ffi.NULL:
            attr.send_cq = s.send_cq
        if attr.recv_cq == ffi.NULL:
            attr.recv_cq = s.recv_cq
        if s.srq != ffi.NULL and attr.srq == ffi.NULL:
            attr.srq = s.srq
        qp = queues.create_qp(pd, attr)
    except BaseException:
        _destroy_cqs(rec)
        raise
    qrec = queues.qp_of(qp)
    try:
        rec.local_ece = (0, 0)  # init_ece: rxe has no ibv_query_ece (EOPNOTSUPP)
        rec.cid.attach_qp(qrec.qp)  # ucma_init_conn_qp / ucma_init_ud_qp
    except BaseException:
        queues.destroy_qp(qp)
        _destroy_cqs(rec)
        raise
    rec.qp, rec.qp_struct = qrec, qp
    cma.sync_qp_state(rec)
    s.pd, s.qp = qp.pd, qp


def destroy_qp(rec: Id) -> None:
    """``rdma_destroy_qp``: the QP (the CM lets go of it first) and the id's CQs."""
    s = rec.struct
    if s.qp != ffi.NULL:
        rec.cid.qp = None
        queues.destroy_qp(s.qp)
    s.qp = ffi.NULL
    rec.qp = rec.qp_struct = None
    _destroy_cqs(rec)


def create_qp_for_request(child: Id, listener: Id) -> None:
    """``rdma_get_request``: the QP a passive endpoint asked for, on the new id."""
    attr = ffi.new("struct ibv_qp_init_attr *")
    ffi.memmove(attr, listener.qp_init_attr, ffi.sizeof("struct ibv_qp_init_attr"))
    create_qp(child, listener.struct.pd, attr)


def _create_srq(rec: Id, pd: Any, attr: Any) -> None:
    s = rec.struct
    if pd == ffi.NULL:
        pd = s.pd
    if attr == ffi.NULL or pd == ffi.NULL:
        raise Errno(errno.EINVAL, "rdma_create_srq: no attributes or no PD")
    if s.qp_type == IBV_QPT_XRC_RECV:
        raise Errno(errno.EOPNOTSUPP, "rdma_create_srq: XRC (rxe has none)")
    srq = lib.ibv_create_srq(pd, attr)
    if srq == ffi.NULL:
        raise Errno(ffi.errno or errno.ENOMEM, "rdma_create_srq: ibv_create_srq failed")
    if s.pd == ffi.NULL:
        s.pd = pd
    s.srq = srq


def _destroy_srq(rec: Id) -> None:
    s = rec.struct
    if s.srq != ffi.NULL:
        lib.ibv_destroy_srq(s.srq)
    s.srq = ffi.NULL
    _destroy_cqs(rec)


def init_qp_attr(rec: Id, attr: Any, mask: Any) -> None:
    """``rdma_init_qp_attr``: the attributes (every field the kernel's answer has, the
    rest zero) and mask to move the id's QP to ``attr->qp_state``."""
    state = _STATES.get(int(attr.qp_state))
    if state is None or mask == ffi.NULL:
        raise Errno(errno.EINVAL, f"rdma_init_qp_attr: state {int(attr.qp_state)} is not "
                                  f"INIT, RTR or RTS")
    a, m = rec.cid.init_qp_attr(state)
    size = ffi.sizeof("struct ibv_qp_attr")
    ffi.memmove(attr, b"\0" * size, size)
    for name in _FIELDS:
        v = getattr(a, name, None)
        if v is not None:
            setattr(attr, name, int(v))
    if a.ah_attr is not None and getattr(a.ah_attr, "gr", None) is not None:
        ah_attr_to_c(a.ah_attr, attr.ah_attr)
    mask[0] = int(m)


def create_ep(res: Any, pd: Any, attr: Any) -> Id:
    """``rdma_create_ep``: a synchronous id, bound (``RAI_PASSIVE``: the QP attributes
    kept for each ``rdma_get_request``) or resolved with its QP (active)."""
    if res == ffi.NULL:
        raise Errno(errno.EINVAL, "rdma_create_ep: res is NULL")
    rec = cma.create_id(ffi.NULL, ffi.NULL, res.ai_port_space, res.ai_qp_type)
    try:
        if res.ai_flags & RAI_PASSIVE:
            cma.bind_addr(rec, res.ai_src_addr)
            if pd != ffi.NULL:
                rec.struct.pd = pd
            if attr != ffi.NULL:
                keep = ffi.new("struct ibv_qp_init_attr *")
                ffi.memmove(keep, attr, ffi.sizeof("struct ibv_qp_init_attr"))
                keep.qp_type = res.ai_qp_type
                rec.qp_init_attr = keep
            return rec
        cma.resolve_addr(rec, res.ai_src_addr if res.ai_src_len else ffi.NULL,
                         res.ai_dst_addr, 2000)
        cma.resolve_route(rec, 2000)
        if attr != ffi.NULL:
            attr.qp_type = res.ai_qp_type
            create_qp(rec, pd, attr)
        if res.ai_connect_len and res.ai_connect != ffi.NULL:
            rec.connect = bytes(ffi.buffer(ffi.cast("char *", res.ai_connect),
                                           res.ai_connect_len))
        return rec
    except BaseException:
        destroy_ep(rec)
        raise


def destroy_ep(rec: Id) -> None:
    """``rdma_destroy_ep``: QP, SRQ, then the id."""
    if rec.struct.qp != ffi.NULL:
        destroy_qp(rec)
    if rec.struct.srq != ffi.NULL:
        _destroy_srq(rec)
    rec.qp_init_attr = None
    cma.destroy_id(rec)


def install(lib_ffi: Any, the_lib: Any) -> None:
    """Define this part's functions."""
    global ffi, lib
    ffi, lib = lib_ffi, the_lib

    @ffi.def_extern(name="rdma_create_qp")
    @cm_call(-1)
    def rdma_create_qp(id: Any, pd: Any, attr: Any) -> int:
        create_qp(id_of(id), pd, attr)
        return 0

    @ffi.def_extern(name="rdma_create_qp_ex")
    @cm_call(-1)
    def rdma_create_qp_ex(id: Any, attr: Any) -> int:
        rec = id_of(id)
        if attr == ffi.NULL:
            raise Errno(errno.EINVAL, "rdma_create_qp_ex: attr is NULL")
        mask = _at(attr, QP_EX_COMP_MASK, "uint32_t")[0]
        flags = _at(attr, QP_EX_CREATE_FLAGS, "uint32_t")[0] \
            if mask & QP_INIT_ATTR_CREATE_FLAGS else 0
        if mask & ~(QP_INIT_ATTR_PD | QP_INIT_ATTR_CREATE_FLAGS) or flags:
            raise Errno(errno.EOPNOTSUPP, f"rdma_create_qp_ex: comp_mask {mask:#x} / "
                                          f"create_flags {flags:#x} (XRC, TSO, RSS, ibv_qp_ex)")
        pdp = _at(attr, QP_EX_PD, "struct ibv_pd *")
        pd = pdp[0] if mask & QP_INIT_ATTR_PD else ffi.NULL
        # the basic structure is the extended one's head: the id's QP from it
        create_qp(rec, pd, ffi.cast("struct ibv_qp_init_attr *", attr))
        _at(attr, QP_EX_COMP_MASK, "uint32_t")[0] = mask | QP_INIT_ATTR_PD
        pdp[0] = rec.struct.pd
        return 0

    @ffi.def_extern(name="rdma_destroy_qp")
    @cm_call(None)
    def rdma_destroy_qp(id: Any) -> None:
        destroy_qp(id_of(id))

    @ffi.def_extern(name="rdma_create_srq")
    @cm_call(-1)
    def rdma_create_srq(id: Any, pd: Any, attr: Any) -> int:
        _create_srq(id_of(id), pd, attr)
        return 0

    @ffi.def_extern(name="rdma_create_srq_ex")
    @cm_call(-1)
    def rdma_create_srq_ex(id: Any, attr: Any) -> int:
        rec = id_of(id)
        if attr == ffi.NULL:
            raise Errno(errno.EINVAL, "rdma_create_srq_ex: attr is NULL")
        mask = _at(attr, SRQ_EX_COMP_MASK, "uint32_t")[0]
        if not mask & SRQ_INIT_ATTR_TYPE:
            raise Errno(errno.EINVAL, "rdma_create_srq_ex: no srq_type in comp_mask")
        if _at(attr, SRQ_EX_TYPE, "uint32_t")[0] != IBV_SRQT_BASIC or \
                mask & ~(SRQ_INIT_ATTR_TYPE | SRQ_INIT_ATTR_PD):
            raise Errno(errno.EOPNOTSUPP, "rdma_create_srq_ex: XRC or tag matching SRQ")
        pdp = _at(attr, SRQ_EX_PD, "struct ibv_pd *")
        pd = pdp[0] if mask & SRQ_INIT_ATTR_PD else ffi.NULL
        _create_srq(rec, pd, ffi.cast("struct ibv_srq_init_attr *", attr))
        _at(attr, SRQ_EX_COMP_MASK, "uint32_t")[0] = mask | SRQ_INIT_ATTR_PD
        pdp[0] = rec.struct.pd if pd == ffi.NULL else pd
        return 0

    @ffi.def_extern(name="rdma_destroy_srq")
    @cm_call(None)
    def rdma_destroy_srq(id: Any) -> None:
        _destroy_srq(id_of(id))

    @ffi.def_extern(name="rdma_init_qp_attr")
    @cm_call(-1)
    def rdma_init_qp_attr(id: Any, attr: Any, mask: Any) -> int:
        if attr == ffi.NULL:
            raise Errno(errno.EINVAL, "rdma_init_qp_attr: qp_attr is NULL")
        init_qp_attr(id_of(id), attr, mask)
        return 0

    @ffi.def_extern(name="rdma_create_ep")
    @cm_call(-1)
    def rdma_create_ep(id_out: Any, res: Any, pd: Any, attr: Any) -> int:
        if id_out == ffi.NULL:
            raise Errno(errno.EINVAL, "rdma_create_ep: id is NULL")
        id_out[0] = create_ep(res, pd, attr).struct
        return 0

    @ffi.def_extern(name="rdma_destroy_ep")
    @cm_call(None)
    def rdma_destroy_ep(id: Any) -> None:
        destroy_ep(id_of(id))

