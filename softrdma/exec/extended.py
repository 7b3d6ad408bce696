"""The extended verbs: ``ibv_create_cq_ex`` with its polling slots, ``ibv_create_qp_ex``
with the work-request builders (``ibv_wr_*``), and memory windows.

All of them are verbs.h inlines calling through a slot: ``create_cq_ex`` and
``create_qp_ex`` of the verbs_context, the ``start_poll``/``read_*`` slots of a ``struct
ibv_cq_ex``, the ``wr_*`` slots of a ``struct ibv_qp_ex``, ``alloc_mw``/``bind_mw``/
``dealloc_mw`` of ``context->ops``. Each slot is filled the way rxe fills it (rdma-core
44's providers/rxe/rxe.c): a read_* slot only for a ``wc_flags`` bit asked for, a wr_*
operation only for a ``send_ops_flags`` bit asked for; anything rxe refuses fails with
EOPNOTSUPP.

The objects are :mod:`softrdma.exec.queues`' CQs and QPs with the longer structure
(``struct ibv_cq_ex`` starts with ``struct ibv_cq``; ``struct ibv_qp_ex`` with ``struct
ibv_qp``): ``ibv_poll_cq``, ``ibv_post_send``, ``ibv_modify_qp``, ``ibv_destroy_*`` work on
them as on any other.

* CQ: ``start_poll`` takes one completion off the soft CQ (ENOENT if there is none), and
  ``next_poll`` the next; the read_* slots read it. Nothing is taken ahead, so a program
  mixing ``ibv_poll_cq`` and ``ibv_start_poll`` loses nothing.
* QP: ``wr_start`` opens a batch, each operation (``ibv_wr_send``, ``ibv_wr_rdma_write``,
  ...) adds a work request that the following ``wr_set_*`` calls complete, and
  ``wr_complete`` posts the batch as one ``ibv_post_send`` (its errno, or the first
  builder's error: ENOSPC past the inline or SGE limit, as rxe). ``wr_abort`` drops it.
"""

from __future__ import annotations

import errno
from typing import Any

from . import devices, queues, shim
from .shim import Errno, guard, handles

__all__ = ["IMPLEMENTS", "CALLBACKS", "install", "cq_ex_state", "qp_ex_state",
           "send_wr_of_bind"]

IMPLEMENTS = ("ibv_qp_to_qp_ex",)


_CQ_READS = ("read_opcode", "read_vendor_err", "read_byte_len", "read_imm_data",
             "read_qp_num", "read_src_qp", "read_wc_flags", "read_slid", "read_sl",
             "read_dlid_path_bits")
_WR_OPS = ("wr_atomic_cmp_swp", "wr_atomic_fetch_add", "wr_bind_mw", "wr_local_inv",
           "wr_rdma_read", "wr_rdma_write", "wr_rdma_write_imm", "wr_send", "wr_send_imm",
           "wr_send_inv", "wr_atomic_write")
_WR_SETS = ("wr_set_ud_addr", "wr_set_inline_data", "wr_set_inline_data_list", "wr_set_sge",
            "wr_set_sge_list", "wr_start", "wr_complete", "wr_abort")

CALLBACKS = """
    extern "Python" struct ibv_cq_ex *softrdma_create_cq_ex(struct ibv_context *,
                                                           struct ibv_cq_init_attr_ex *);
    extern "Python" int softrdma_start_poll(struct ibv_cq_ex *, struct ibv_poll_cq_attr *);
    extern "Python" int softrdma_next_poll(struct ibv_cq_ex *);
    extern "Python" void softrdma_end_poll(struct ibv_cq_ex *);
    extern "Python" enum ibv_wc_opcode softrdma_read_opcode(struct ibv_cq_ex *);
    extern "Python" uint32_t softrdma_read_vendor_err(struct ibv_cq_ex *);
    extern "Python" uint32_t softrdma_read_byte_len(struct ibv_cq_ex *);
    extern "Python" uint32_t softrdma_read_imm_data(struct ibv_cq_ex *);
    extern "Python" uint32_t softrdma_read_qp_num(struct ibv_cq_ex *);
    extern "Python" uint32_t softrdma_read_src_qp(struct ibv_cq_ex *);
    extern "Python" unsigned int softrdma_read_wc_flags(struct ibv_cq_ex *);
    extern "Python" uint32_t softrdma_read_slid(struct ibv_cq_ex *);
    extern "Python" uint8_t softrdma_read_sl(struct ibv_cq_ex *);
    extern "Python" uint8_t softrdma_read_dlid_path_bits(struct ibv_cq_ex *);
    extern "Python" struct ibv_qp *softrdma_create_qp_ex(struct ibv_context *,
                                                        struct ibv_qp_init_attr_ex *);
    extern "Python" void softrdma_wr_atomic_cmp_swp(struct ibv_qp_ex *, uint32_t, uint64_t,
                                                    uint64_t, uint64_t);
    extern "Python" void softrdma_wr_atomic_fetch_add(struct ibv_qp_ex *, uint32_t, uint64_t,
                                                      uint64_t);
    extern "Python" void softrdma_wr_bind_mw(struct ibv_qp_ex *, struct ibv_mw *, uint32_t,
                                             const struct ibv_mw_bind_info *);
    extern "Python" void softrdma_wr_local_inv(struct ibv_qp_ex *, uint32_t);
    extern "Python" void softrdma_wr_rdma_read(struct ibv_qp_ex *, uint32_t, uint64_t);
    extern "Python" void softrdma_wr_rdma_write(struct ibv_qp_ex *, uint32_t, uint64_t);
    extern "Python" void softrdma_wr_rdma_write_imm(struct ibv_qp_ex *, uint32_t, uint64_t,
                                                    uint32_t);
    extern "Python" void softrdma_wr_atomic_write(struct ibv_qp_ex *, uint32_t, uint64_t,
                                                  const void *);
    extern "Python" void softrdma_wr_send(struct ibv_qp_ex *);
    extern "Python" void softrdma_wr_send_imm(struct ibv_qp_ex *, uint32_t);
    extern "Python" void softrdma_wr_send_inv(struct ibv_qp_ex *, uint32_t);
    extern "Python" void softrdma_wr_set_ud_addr(struct ibv_qp_ex *, struct ibv_ah *,
                                                 uint32_t, uint32_t);
    extern "Python" void softrdma_wr_set_inline_data(struct ibv_qp_ex *, void *, size_t);
    extern "Python" void softrdma_wr_set_inline_data_list(struct ibv_qp_ex *, size_t,
                                                          const struct ibv_data_buf *);
    extern "Python" void softrdma_wr_set_sge(struct ibv_qp_ex *, uint32_t, uint64_t,
                                             uint32_t);
    extern "Python" void softrdma_wr_set_sge_list(struct ibv_qp_ex *, size_t,
                                                  const struct ibv_sge *);
    extern "Python" void softrdma_wr_start(struct ibv_qp_ex *);
    extern "Python" int softrdma_wr_complete(struct ibv_qp_ex *);
    extern "Python" void softrdma_wr_abort(struct ibv_qp_ex *);
    extern "Python" struct ibv_mw *softrdma_alloc_mw(struct ibv_pd *, enum ibv_mw_type);
    extern "Python" int softrdma_dealloc_mw(struct ibv_mw *);
    extern "Python" int softrdma_bind_mw(struct ibv_qp *, struct ibv_mw *,
                                         struct ibv_mw_bind *);
"""

ENOENT, EINVAL, EOPNOTSUPP, ENOSPC = errno.ENOENT, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSPC

# enum ibv_create_cq_wc_flags: what rxe supports (RXE_SUP_WC_EX_FLAGS), by read slot
_WC_EX = {"read_byte_len": 1 << 0, "read_imm_data": 1 << 1, "read_qp_num": 1 << 2,
          "read_src_qp": 1 << 3, "read_slid": 1 << 4, "read_sl": 1 << 5,
          "read_dlid_path_bits": 1 << 6}
_RXE_WC_FLAGS = sum(_WC_EX.values())
_CQ_INIT_ATTR_MASK_FLAGS, _CQ_INIT_ATTR_MASK_PD = 1, 2

# ibv_qp_init_attr_mask and enum ibv_qp_create_send_ops_flags
_QP_INIT_PD, _QP_INIT_CREATE_FLAGS, _QP_INIT_SEND_OPS = 1 << 0, 1 << 2, 1 << 6
_RXE_QP_COMP_MASK = _QP_INIT_PD | _QP_INIT_CREATE_FLAGS | _QP_INIT_SEND_OPS
_SEND_OPS = {"wr_rdma_write": 1 << 0, "wr_rdma_write_imm": 1 << 1, "wr_send": 1 << 2,
             "wr_send_imm": 1 << 3, "wr_rdma_read": 1 << 4, "wr_atomic_cmp_swp": 1 << 5,
             "wr_atomic_fetch_add": 1 << 6, "wr_local_inv": 1 << 7, "wr_bind_mw": 1 << 8,
             "wr_send_inv": 1 << 9, "wr_atomic_write": 1 << 12}
# IBV_QP_EX_WITH_FLUSH: rxe accepts it, but its wr_flush slot lies past the rdma-core 44
# struct ibv_qp_ex this backend builds (added in 45): a program compiled against 45 or
# later would call a slot that is not there, so the flag is refused (EOPNOTSUPP)
_RXE_SEND_OPS = {2: sum(_SEND_OPS.values()),  # RC
                 3: sum(_SEND_OPS[k] for k in ("wr_rdma_write", "wr_rdma_write_imm", "wr_send",
                                               "wr_send_imm", "wr_bind_mw", "wr_send_inv")),
                 4: _SEND_OPS["wr_send"] | _SEND_OPS["wr_send_imm"]}  # UD

# enum ibv_wr_opcode
_OP = {"wr_rdma_write": 0, "wr_rdma_write_imm": 1, "wr_send": 2, "wr_send_imm": 3,
       "wr_rdma_read": 4, "wr_atomic_cmp_swp": 5, "wr_atomic_fetch_add": 6,
       "wr_local_inv": 7, "wr_bind_mw": 8, "wr_send_inv": 9, "wr_atomic_write": 15}
_SEND_INLINE = 1 << 3


def _bswap32(v: int) -> int:
    return int.from_bytes(v.to_bytes(4, "little"), "big")


class CqExState:
    """A cq_ex's current completion: the ``struct ibv_wc`` the read_* slots read."""

    __slots__ = ("rec", "struct", "wc", "poll")

    def __init__(self, rec: Any, struct: Any) -> None:
        self.rec, self.struct = rec, struct
        self.wc = shim.ffi.new("struct ibv_wc *")
        self.poll = rec.poll


class QpExState:
    """A qp_ex's batch of work requests between wr_start and wr_complete."""

    __slots__ = ("rec", "struct", "wrs", "err", "max_inline", "max_sge")

    def __init__(self, rec: Any, struct: Any) -> None:
        self.rec, self.struct = rec, struct
        self.wrs: list[Any] = []
        self.err = 0
        self.max_inline = rec.qp.cap.max_inline_data
        self.max_sge = rec.max_send_sge


_cq_ex: dict[int, CqExState] = {}  # address of a struct ibv_cq_ex -> its state
_qp_ex: dict[int, QpExState] = {}  # address of a struct ibv_qp_ex -> its state


def cq_ex_state(ptr: Any) -> CqExState:
    st = _cq_ex.get(shim.address(ptr))
    if st is None:
        raise Errno(EINVAL, "not an extended CQ of softrdma exec")
    return st


def qp_ex_state(ptr: Any) -> QpExState:
    st = _qp_ex.get(shim.address(ptr))
    if st is None:
        raise Errno(EINVAL, "not an extended QP of softrdma exec")
    return st


def _prune() -> None:
    """Forget the states of CQs and QPs ibv_destroy_* has destroyed since (their
    structures then go with them): queues' records are the truth."""
    for states, live in ((_cq_ex, queues.live_cq), (_qp_ex, queues.live_qp)):
        for addr in [a for a, st in states.items() if live(a) is not st.rec]:
            del states[addr]


def send_wr_of_bind(mw_ptr: Any, rkey: int, info: Any, wr_id: int, flags: int) -> Any:
    """A BIND_MW SendWR from C values: the window, its new rkey, a ``struct
    ibv_mw_bind_info *`` (its MR may be NULL: an unbind)."""
    from ..verbs_api import MWBindInfo, SendWR
    mw = handles.get("mw", mw_ptr)
    mr = None if info.mr == shim.ffi.NULL else handles.get("mr", info.mr)
    wr = SendWR(wr_id, _OP["wr_bind_mw"], 0, 0, (), flags)
    wr.set_bind_wr(mw, MWBindInfo(mr, int(info.addr), int(info.length),
                                  int(info.mw_access_flags)), rkey)
    return wr


def install(ffi: Any, lib: Any) -> None:
    """Define the slots' callbacks and fill the context's slots at open."""
    from ..verbs_api import SGE, SendWR, MW

    NULL = ffi.NULL
    addr_of = shim.address
    cq_states, qp_states = _cq_ex, _qp_ex

    # ---- CQs ---------------------------------------------------------------------------
    @ffi.def_extern(name="softrdma_create_cq_ex")
    @guard(NULL)
    def create_cq_ex(ctx: Any, attr: Any) -> Any:
        devices.context_of(ctx)
        if attr == NULL:
            raise Errno(EINVAL, "ibv_create_cq_ex: attr is NULL")
        if attr.wc_flags & ~_RXE_WC_FLAGS:
            raise Errno(EOPNOTSUPP, "ibv_create_cq_ex: wc_flags rxe does not support")
        if attr.comp_mask & ~(_CQ_INIT_ATTR_MASK_FLAGS | _CQ_INIT_ATTR_MASK_PD):
            raise Errno(EOPNOTSUPP, "ibv_create_cq_ex: unknown comp_mask bits")
        mem = queues.create_cq(ctx, attr.cqe, attr.cq_context, attr.channel,
                               attr.comp_vector, "struct ibv_cq_ex")
        cq = ffi.cast("struct ibv_cq_ex *", mem)
        cq.start_poll, cq.next_poll = lib.softrdma_start_poll, lib.softrdma_next_poll
        cq.end_poll = lib.softrdma_end_poll
        for slot in _CQ_READS:
            bit = _WC_EX.get(slot)
            if bit is None or attr.wc_flags & bit:
                setattr(cq, slot, getattr(lib, "softrdma_" + slot))
        _prune()
        cq_states[addr_of(cq)] = CqExState(queues.cq_of(cq), cq)
        return cq

    def take(st: CqExState, cq: Any) -> int:
        got, wcs = st.poll(1)
        if not got:
            ffi.errno = ENOENT
            return ENOENT
        w = wcs[0]
        queues.fill_wc(st.wc, w)
        cq.status, cq.wr_id = w.status, w.wr_id
        return 0

    @ffi.def_extern(name="softrdma_start_poll")
    @guard("errno")
    def start_poll(cq: Any, attr: Any) -> int:
        st = cq_states.get(addr_of(cq))
        if st is None:
            raise Errno(EINVAL, "ibv_start_poll: not an extended CQ of softrdma exec")
        if attr != NULL and attr.comp_mask:
            raise Errno(EINVAL, "ibv_start_poll: comp_mask must be 0")
        return take(st, cq)

    @ffi.def_extern(name="softrdma_next_poll")
    @guard("errno")
    def next_poll(cq: Any) -> int:
        return take(cq_states[addr_of(cq)], cq)

    @ffi.def_extern(name="softrdma_end_poll")
    @guard(None)
    def end_poll(cq: Any) -> None:
        return None  # nothing is held between the polls

    def reader(field: str) -> Any:
        def read(cq: Any) -> int:
            return getattr(cq_states[addr_of(cq)].wc, field)
        return read

    for slot in _CQ_READS:
        ffi.def_extern(name="softrdma_" + slot)(guard(0)(reader(slot.removeprefix("read_"))))

    # ---- QPs ---------------------------------------------------------------------------
    @ffi.def_extern(name="softrdma_create_qp_ex")
    @guard(NULL)
    def create_qp_ex(ctx: Any, attr: Any) -> Any:
        devices.context_of(ctx)
        if attr == NULL:
            raise Errno(EINVAL, "ibv_create_qp_ex: attr is NULL")
        mask = attr.comp_mask
        # rxe's check_qp_init_attr: EOPNOTSUPP for what it does not know
        if mask & ~_RXE_QP_COMP_MASK or (mask & _QP_INIT_CREATE_FLAGS and attr.create_flags):
            raise Errno(EOPNOTSUPP, "ibv_create_qp_ex: comp_mask/create_flags rxe refuses")
        ops = attr.send_ops_flags if mask & _QP_INIT_SEND_OPS else 0
        if mask & _QP_INIT_SEND_OPS and ops & ~_RXE_SEND_OPS.get(attr.qp_type, 0):
            raise Errno(EOPNOTSUPP, "ibv_create_qp_ex: send_ops_flags rxe refuses "
                                    "for this QP type")
        if not mask & _QP_INIT_PD:
            raise Errno(EINVAL, "ibv_create_qp_ex: a PD is required (IBV_QP_INIT_ATTR_PD)")
        mem = queues.make_qp(attr.pd, attr.qp_type, attr.send_cq, attr.recv_cq, attr.srq,
                             ffi.addressof(attr, "cap"), attr.sq_sig_all, attr.qp_context,
                             "struct ibv_qp_ex")
        qpx = ffi.cast("struct ibv_qp_ex *", mem)
        for slot in _WR_OPS:
            if ops & _SEND_OPS[slot]:
                setattr(qpx, slot, getattr(lib, "softrdma_" + slot))
        for slot in _WR_SETS:
            setattr(qpx, slot, getattr(lib, "softrdma_" + slot))
        _prune()
        qp_states[addr_of(qpx)] = QpExState(queues.qp_of(qpx), qpx)
        return ffi.cast("struct ibv_qp *", qpx)

    @ffi.def_extern(name="ibv_qp_to_qp_ex")
    @guard(NULL)
    def qp_to_qp_ex(qp: Any) -> Any:
        # libibverbs: the qp_ex of a QP made by ibv_create_qp_ex, NULL for any other
        st = qp_states.get(addr_of(qp))
        if st is None or queues.live_qp(addr_of(qp)) is not st.rec:
            return NULL
        return st.struct

    def add(qp: Any, opcode: int, imm: int = 0) -> Any:
        """A new WR of the batch, with the qp_ex's wr_id and wr_flags of now."""
        st = qp_states[addr_of(qp)]
        wr = SendWR(qp.wr_id, opcode, 0, imm, (), qp.wr_flags)
        st.wrs.append(wr)
        return wr

    @ffi.def_extern(name="softrdma_wr_send")
    @guard(None)
    def wr_send(qp: Any) -> None:
        add(qp, 2)

    @ffi.def_extern(name="softrdma_wr_send_imm")
    @guard(None)
    def wr_send_imm(qp: Any, imm: int) -> None:
        add(qp, 3, _bswap32(imm))  # __be32 from the program

    @ffi.def_extern(name="softrdma_wr_send_inv")
    @guard(None)
    def wr_send_inv(qp: Any, rkey: int) -> None:
        add(qp, 9, rkey)

    @ffi.def_extern(name="softrdma_wr_local_inv")
    @guard(None)
    def wr_local_inv(qp: Any, rkey: int) -> None:
        add(qp, 7, rkey)

    @ffi.def_extern(name="softrdma_wr_rdma_write")
    @guard(None)
    def wr_rdma_write(qp: Any, rkey: int, remote_addr: int) -> None:
        add(qp, 0).set_wr_rdma(rkey, remote_addr)

    @ffi.def_extern(name="softrdma_wr_rdma_write_imm")
    @guard(None)
    def wr_rdma_write_imm(qp: Any, rkey: int, remote_addr: int, imm: int) -> None:
        add(qp, 1, _bswap32(imm)).set_wr_rdma(rkey, remote_addr)

    @ffi.def_extern(name="softrdma_wr_rdma_read")
    @guard(None)
    def wr_rdma_read(qp: Any, rkey: int, remote_addr: int) -> None:
        add(qp, 4).set_wr_rdma(rkey, remote_addr)

    @ffi.def_extern(name="softrdma_wr_atomic_cmp_swp")
    @guard(None)
    def wr_atomic_cmp_swp(qp: Any, rkey: int, remote_addr: int, compare: int,
                          swap: int) -> None:
        add(qp, 5).set_wr_atomic(rkey, remote_addr, compare, swap)

    @ffi.def_extern(name="softrdma_wr_atomic_fetch_add")
    @guard(None)
    def wr_atomic_fetch_add(qp: Any, rkey: int, remote_addr: int, value: int) -> None:
        add(qp, 6).set_wr_atomic(rkey, remote_addr, value)

    @ffi.def_extern(name="softrdma_wr_atomic_write")
    @guard(None)
    def wr_atomic_write(qp: Any, rkey: int, remote_addr: int, atomic_wr: Any) -> None:
        # librxe copies the 8 bytes into the WQE at once: the program may reuse its buffer
        add(qp, 15).set_wr_atomic_write(rkey, remote_addr, bytes(ffi.buffer(atomic_wr, 8)))

    @ffi.def_extern(name="softrdma_wr_bind_mw")
    @guard(None)
    def wr_bind_mw(qp: Any, mw: Any, rkey: int, info: Any) -> None:
        st = qp_states[addr_of(qp)]
        try:
            st.wrs.append(send_wr_of_bind(mw, rkey, info, qp.wr_id, qp.wr_flags))
        except Errno as e:
            st.err = st.err or e.error_code

    def last(qp: Any) -> tuple[QpExState, Any]:
        """The batch and its newest WR (None before the first operation: the setters
        then do nothing, where rxe would write past its queue)."""
        st = qp_states[addr_of(qp)]
        return st, (st.wrs[-1] if st.wrs else None)

    @ffi.def_extern(name="softrdma_wr_set_sge")
    @guard(None)
    def wr_set_sge(qp: Any, lkey: int, addr: int, length: int) -> None:
        st, wr = last(qp)
        if wr is None or st.err:
            return
        if length:  # rxe: a zero length leaves the WR without an SGE
            wr.sg_list, wr.num_sge = [SGE(addr, length, lkey)], 1

    @ffi.def_extern(name="softrdma_wr_set_sge_list")
    @guard(None)
    def wr_set_sge_list(qp: Any, n: int, sgl: Any) -> None:
        st, wr = last(qp)
        if wr is None or st.err:
            return
        if n > st.max_sge:
            st.err = ENOSPC
            return
        wr.sg_list = [SGE(sgl[i].addr, sgl[i].length, sgl[i].lkey) for i in range(n)]
        wr.num_sge = n

    def set_inline(st: QpExState, wr: Any, parts: list[bytes]) -> None:
        data = b"".join(parts)
        if len(data) > st.max_inline:
            st.err = ENOSPC
            return
        # copied now: the program may reuse its buffers as soon as the call returns
        wr.sg_list, wr.num_sge, wr.inline_data = [], 0, data
        wr.send_flags |= _SEND_INLINE

    @ffi.def_extern(name="softrdma_wr_set_inline_data")
    @guard(None)
    def wr_set_inline_data(qp: Any, addr: Any, length: int) -> None:
        st, wr = last(qp)
        if wr is None or st.err:
            return
        set_inline(st, wr, [bytes(ffi.buffer(addr, length))] if length else [])

    @ffi.def_extern(name="softrdma_wr_set_inline_data_list")
    @guard(None)
    def wr_set_inline_data_list(qp: Any, n: int, bufs: Any) -> None:
        st, wr = last(qp)
        if wr is None or st.err:
            return
        set_inline(st, wr, [bytes(ffi.buffer(bufs[i].addr, bufs[i].length))
                            for i in range(n) if bufs[i].length])

    @ffi.def_extern(name="softrdma_wr_set_ud_addr")
    @guard(None)
    def wr_set_ud_addr(qp: Any, ah: Any, remote_qpn: int, remote_qkey: int) -> None:
        st, wr = last(qp)
        if wr is None or st.err:
            return
        try:
            wr.set_wr_ud(handles.get("ah", ah), remote_qpn, remote_qkey)
        except Errno as e:
            st.err = e.error_code

    @ffi.def_extern(name="softrdma_wr_start")
    @guard(None)
    def wr_start(qp: Any) -> None:
        st = qp_states[addr_of(qp)]
        st.wrs, st.err = [], 0

    @ffi.def_extern(name="softrdma_wr_complete")
    @guard("errno")
    def wr_complete(qp: Any) -> int:
        st = qp_states.get(addr_of(qp))
        if st is None:
            raise Errno(EINVAL, "ibv_wr_complete: not an extended QP of softrdma exec")
        wrs, err = st.wrs, st.err
        st.wrs, st.err = [], 0
        if err:
            return err
        if not wrs:
            return 0
        queues.note_post()
        try:
            st.rec.post_send(wrs)
        except OSError as e:
            return getattr(e, "error_code", None) or e.errno or EINVAL
        return 0

    @ffi.def_extern(name="softrdma_wr_abort")
    @guard(None)
    def wr_abort(qp: Any) -> None:
        st = qp_states[addr_of(qp)]
        st.wrs, st.err = [], 0

    # ---- memory windows ----------------------------------------------------------------
    @ffi.def_extern(name="softrdma_alloc_mw")
    @guard(NULL)
    def alloc_mw(pd_ptr: Any, mw_type: int) -> Any:
        pd = handles.get("pd", pd_ptr)
        try:
            mw = MW(pd, mw_type)
        except OSError as e:
            raise Errno(getattr(e, "error_code", None) or e.errno or EINVAL, str(e)) from None
        s = ffi.new("struct ibv_mw *")
        s.context, s.pd, s.rkey, s.handle = pd_ptr.context, pd_ptr, mw.rkey, mw.handle
        s.type = mw_type
        return handles.add("mw", s, mw)

    @ffi.def_extern(name="softrdma_dealloc_mw")
    @guard("errno")
    def dealloc_mw(mw_ptr: Any) -> int:
        mw = handles.get("mw", mw_ptr)
        try:
            mw.close()
        except OSError as e:
            return getattr(e, "error_code", None) or e.errno or EINVAL
        handles.release("mw", mw_ptr)
        return 0

    shim.destroyers["mw"] = dealloc_mw

    @ffi.def_extern(name="softrdma_bind_mw")
    @guard("errno")
    def bind_mw(qp_ptr: Any, mw_ptr: Any, bind: Any) -> int:
        # rxe_bind_mw: a type 1 bind posted as an IBV_WR_BIND_MW with ibv_inc_rkey of the
        # window's rkey, which the program finds in mw->rkey at once
        rec = queues.qp_of(qp_ptr)
        handles.get("mw", mw_ptr)
        if bind == NULL or mw_ptr.type != 1:
            return EINVAL
        new = (mw_ptr.rkey & ~0xFF) | ((mw_ptr.rkey + 1) & 0xFF)
        wr = send_wr_of_bind(mw_ptr, new, bind.bind_info, bind.wr_id, bind.send_flags)
        queues.note_post()
        try:
            rec.post_send([wr])
        except OSError as e:
            return getattr(e, "error_code", None) or e.errno or EINVAL
        mw_ptr.rkey = new
        return 0

    def on_open(ctx: Any, c: Any) -> None:
        devices.set_op(ctx, "create_cq_ex", lib.softrdma_create_cq_ex)
        devices.set_op(ctx, "create_qp_ex", lib.softrdma_create_qp_ex)
        devices.set_op(ctx, "alloc_mw", lib.softrdma_alloc_mw)
        devices.set_op(ctx, "dealloc_mw", lib.softrdma_dealloc_mw)
        devices.set_op(ctx, "bind_mw", lib.softrdma_bind_mw)

    devices.ON_OPEN.append(on_open)
