"""Queue pairs: create, modify (the state machine), query, post, destroy.

``QP(pd, QPInitAttr(...), qp_attr=None)`` creates a QP in RESET; with ``qp_attr`` it moves
an RC/UC QP to INIT and a UD QP to RTS, as pyverbs does. ``modify(attr, mask)`` applies
the kernel's transition table (see :mod:`softrdma.qp.transitions`) and rxe's attribute
checks; a failed modify changes nothing. ``to_init``/``to_rtr``/``to_rts`` use the masks
pyverbs uses.

What each state allows (IBTA, as rxe enforces it): ``post_recv`` from INIT on (EINVAL in
RESET); ``post_send`` in RTS, SQD, SQE and ERR (EINVAL before RTS). Entering ERR completes
every outstanding work request of both queues with IBV_WC_WR_FLUSH_ERR, and anything
posted afterwards is flushed the same way. RESET empties both queues without completions.
"""

from __future__ import annotations

import errno
from collections import deque
from typing import Any, Iterable

from ..errors import PyverbsRDMAError
from ..qp.transitions import check_transition
from ..qp.wqe import RecvWqe, SendWqe
from .ah import AddressVector, resolve_av
from .attr import AHAttr, QPAttr, QPCap, QPInitAttr
from .base import Resource
from .cq import _async, _ring_size
from .enums import (
    ibv_event_type, ibv_mtu, ibv_qp_attr_mask as M, ibv_qp_state as S, ibv_qp_type as T,
    ibv_send_flags as F, ibv_wc_status, ibv_wr_opcode as W,
)
from .wr import RecvWR, SendWR, WC

__all__ = ["QP"]

# Work request opcodes each QP type accepts (rxe_wr_opcode_info of the 6.1 kernel).
_ALLOWED_OPS = {
    T.IBV_QPT_RC: {W.IBV_WR_RDMA_WRITE, W.IBV_WR_RDMA_WRITE_WITH_IMM, W.IBV_WR_SEND,
                   W.IBV_WR_SEND_WITH_IMM, W.IBV_WR_RDMA_READ, W.IBV_WR_ATOMIC_CMP_AND_SWP,
                   W.IBV_WR_ATOMIC_FETCH_AND_ADD, W.IBV_WR_LOCAL_INV, W.IBV_WR_BIND_MW,
                   W.IBV_WR_SEND_WITH_INV},
    T.IBV_QPT_UC: {W.IBV_WR_RDMA_WRITE, W.IBV_WR_RDMA_WRITE_WITH_IMM, W.IBV_WR_SEND,
                   W.IBV_WR_SEND_WITH_IMM, W.IBV_WR_LOCAL_INV, W.IBV_WR_BIND_MW,
                   W.IBV_WR_SEND_WITH_INV},
    T.IBV_QPT_UD: {W.IBV_WR_SEND, W.IBV_WR_SEND_WITH_IMM},
}
_ATOMIC_OPS = {W.IBV_WR_ATOMIC_CMP_AND_SWP, W.IBV_WR_ATOMIC_FETCH_AND_ADD}
_INLINE_OK = {W.IBV_WR_RDMA_WRITE, W.IBV_WR_RDMA_WRITE_WITH_IMM, W.IBV_WR_SEND,
              W.IBV_WR_SEND_WITH_IMM, W.IBV_WR_SEND_WITH_INV}
_SGE_SIZE = 16  # sizeof(struct ib_sge): rxe sizes the send WQE by SGEs or inline bytes
MAX_MSG = 1 << 31


def _chain(wr: Any) -> Iterable[Any]:
    """A WR, a ``next_wr`` chain of WRs, or a list of WRs, in order."""
    if isinstance(wr, (list, tuple)):
        yield from wr
        return
    while wr is not None:
        yield wr
        wr = getattr(wr, "next_wr", None)


def _sges(wr: Any, max_sge: int, what: str) -> tuple[list[tuple[int, int, int]], int]:
    n = wr.num_sge
    if n < 0 or n > len(wr.sg_list):
        raise PyverbsRDMAError(f"{what}: num_sge {n} but {len(wr.sg_list)} SGEs given",
                               errno.EINVAL)
    if n > max_sge:
        raise PyverbsRDMAError(f"{what}: num_sge {n} exceeds the QP's max_sge {max_sge}",
                               errno.EINVAL)
    out = []
    total = 0
    for s in wr.sg_list[:n]:
        if s.length < 0 or s.length > 0xFFFFFFFF:
            raise PyverbsRDMAError(f"{what}: SGE length {s.length} is not a 32-bit length",
                                   errno.EINVAL)
        out.append((int(s.addr), int(s.length), int(s.lkey)))
        total += s.length
    if total > MAX_MSG:
        raise PyverbsRDMAError(f"{what}: message of {total} bytes exceeds 2^31", errno.EINVAL)
    return out, total


def _post_recv_checks(device: Any, pd: Any, wr: RecvWR, max_sge: int, what: str) -> RecvWqe:
    sges, total = _sges(wr, max_sge, f"Failed to post receive to {what}")
    return RecvWqe(wr.wr_id, sges, total)


class QP(Resource):
    _kind = "QP"

    def __init__(self, pd_or_ctx: Any, init_attr: QPInitAttr, qp_attr: QPAttr | None = None,
                 **kwargs: Any) -> None:
        pd = pd_or_ctx
        pd._check()
        what = "Failed to create QP"
        dev = pd.device
        lim = dev.limits
        qpt = init_attr.qp_type
        if qpt not in _ALLOWED_OPS:
            raise PyverbsRDMAError(f"{what}: qp_type {qpt} is not supported (RC, UC, UD)",
                                   errno.EOPNOTSUPP if qpt in T._value2member_map_ else errno.EINVAL)
        scq, rcq, srq = init_attr.scq, init_attr.rcq, init_attr.srq
        if scq is None or rcq is None:
            raise PyverbsRDMAError(f"{what}: both a send CQ (scq) and a receive CQ (rcq) are "
                                   f"required", errno.EINVAL)
        for o in (scq, rcq, srq):
            if o is not None:
                o._check()
                if o.device is not dev:
                    raise PyverbsRDMAError(f"{what}: CQ/SRQ from another device", errno.EINVAL)
        if srq is not None and srq.pd is not pd:
            pass  # allowed by the verbs; an SRQ may be in another PD of the same context
        cap = init_attr.cap or QPCap()
        # rxe_qp_chk_cap
        for name, val, mx in (("max_send_wr", cap.max_send_wr, lim.max_qp_wr),
                              ("max_send_sge", cap.max_send_sge, lim.max_sge),
                              ("max_inline_data", cap.max_inline_data, lim.max_inline_data)):
            if val < 0 or val > mx:
                raise PyverbsRDMAError(f"{what}: cap.{name} {val} exceeds the device limit {mx}",
                                       errno.EINVAL)
        if srq is None:
            for name, val, mx in (("max_recv_wr", cap.max_recv_wr, lim.max_qp_wr),
                                  ("max_recv_sge", cap.max_recv_sge, lim.max_sge)):
                if val < 0 or val > mx:
                    raise PyverbsRDMAError(f"{what}: cap.{name} {val} exceeds the device limit "
                                           f"{mx}", errno.EINVAL)
        with dev.lock:
            if len(dev.qps) >= lim.max_qp:
                raise PyverbsRDMAError(f"{what}: too many QPs", errno.ENOMEM)
            super().__init__(pd.context)
            self.qp_num = dev.alloc_qpn()
            dev.qps[self.qp_num] = self
        self.pd = pd
        self.qp_type = T(qpt)
        self.qp_context = init_attr.qp_context
        self.send_cq = scq
        self.recv_cq = rcq
        self.srq = srq
        self.sq_sig_all = bool(init_attr.sq_sig_all)
        # Sizes as rxe reports them back (rxe_qp_init_req / init_resp)
        wqe_size = max(cap.max_send_sge * _SGE_SIZE, cap.max_inline_data)
        self.cap = QPCap(max_send_wr=_ring_size(cap.max_send_wr),
                         max_recv_wr=0 if srq else _ring_size(cap.max_recv_wr),
                         max_send_sge=wqe_size // _SGE_SIZE,
                         max_recv_sge=0 if srq else cap.max_recv_sge,
                         max_inline_data=wqe_size)
        init_attr.cap = QPCap(**self.cap.__dict__)
        self.state = S.IBV_QPS_RESET
        self.attr = QPAttr(qp_state=S.IBV_QPS_RESET, cur_qp_state=S.IBV_QPS_RESET,
                           path_mtu=ibv_mtu.IBV_MTU_256, cap=self.cap)
        self.av: AddressVector | None = None
        self.sq: deque[SendWqe] = deque()
        self.rq: deque[RecvWqe] = deque()
        self.comm_est_sent = False
        self._use(pd, scq, rcq, srq)
        from ..qp.engine import QpEngine
        self.engine = QpEngine(self)
        if qp_attr is not None:
            if self.qp_type == T.IBV_QPT_UD:
                self.to_rts(qp_attr)
            else:
                self.to_init(qp_attr)

    # -- properties ------------------------------------------------------------------
    @property
    def qp_state(self) -> int:
        return self.state

    @property
    def sq_draining(self) -> bool:
        return self.state == S.IBV_QPS_SQD and self.engine.in_flight()

    # -- modify ----------------------------------------------------------------------
    def modify(self, attr: QPAttr, attr_mask: int) -> None:
        self._check()
        with self.device.lock:
            self._modify(attr, int(attr_mask))
            self.device.after_post()  # a move to RTS may have sent queued work

    def _modify(self, attr: QPAttr, mask: int) -> None:
        what = "Failed to modify QP"
        cur = attr.cur_qp_state if mask & M.IBV_QP_CUR_STATE else self.state
        new = attr.qp_state if mask & M.IBV_QP_STATE else cur
        for name, val in (("qp_state", new), ("cur_qp_state", cur)):
            if val not in S._value2member_map_ or val == S.IBV_QPS_UNKNOWN:
                raise PyverbsRDMAError(f"{what}: {name} {val} is not a QP state", errno.EINVAL)
        if mask & M.IBV_QP_CUR_STATE and cur != self.state:
            # rxe trusts cur_qp_state only as a hint that must agree with the real state
            raise PyverbsRDMAError(f"{what}: cur_qp_state {S(cur).name} does not match the QP "
                                   f"state {S(self.state).name}", errno.EINVAL)
        check_transition(cur, new, self.qp_type, mask)
        # rxe_qp_chk_attr
        if self.state == S.IBV_QPS_SQD and mask & M.IBV_QP_STATE and new != S.IBV_QPS_ERR \
                and self.sq_draining:
            raise PyverbsRDMAError(f"{what}: the send queue is still draining", errno.EINVAL)
        lim = self.device.limits
        if mask & M.IBV_QP_PORT and attr.port_num != 1:
            raise PyverbsRDMAError(f"{what}: port_num {attr.port_num} is not 1", errno.EINVAL)
        if mask & M.IBV_QP_PKEY_INDEX and not 0 <= attr.pkey_index < lim.max_pkeys:
            raise PyverbsRDMAError(f"{what}: pkey_index {attr.pkey_index} is outside "
                                   f"0..{lim.max_pkeys - 1}", errno.EINVAL)
        av = None
        if mask & M.IBV_QP_AV:
            av = resolve_av(self.device, attr.ah_attr, f"{what}: ah_attr")
        if mask & M.IBV_QP_ALT_PATH:
            resolve_av(self.device, attr.alt_ah_attr, f"{what}: alt_ah_attr")
            if attr.alt_port_num != 1:
                raise PyverbsRDMAError(f"{what}: alt_port_num {attr.alt_port_num} is not 1",
                                       errno.EINVAL)
            if attr.alt_timeout > 31:
                raise PyverbsRDMAError(f"{what}: alt_timeout {attr.alt_timeout} > 31", errno.EINVAL)
        if mask & M.IBV_QP_PATH_MTU and not ibv_mtu.IBV_MTU_256 <= attr.path_mtu <= self.device.max_mtu:
            raise PyverbsRDMAError(f"{what}: path_mtu {attr.path_mtu} is not an IBV_MTU_* value "
                                   f"up to the port's max_mtu", errno.EINVAL)
        if mask & M.IBV_QP_MAX_QP_RD_ATOMIC and not 0 <= attr.max_rd_atomic <= lim.max_qp_init_rd_atom:
            raise PyverbsRDMAError(f"{what}: max_rd_atomic {attr.max_rd_atomic} exceeds "
                                   f"{lim.max_qp_init_rd_atom}", errno.EINVAL)
        if mask & M.IBV_QP_MAX_DEST_RD_ATOMIC and not 0 <= attr.max_dest_rd_atomic <= lim.max_qp_rd_atom:
            raise PyverbsRDMAError(f"{what}: max_dest_rd_atomic {attr.max_dest_rd_atomic} "
                                   f"exceeds {lim.max_qp_rd_atom}", errno.EINVAL)
        for bit, name, val, mx in ((M.IBV_QP_TIMEOUT, "timeout", attr.timeout, 31),
                                   (M.IBV_QP_RETRY_CNT, "retry_cnt", attr.retry_cnt, 7),
                                   (M.IBV_QP_RNR_RETRY, "rnr_retry", attr.rnr_retry, 7),
                                   (M.IBV_QP_MIN_RNR_TIMER, "min_rnr_timer", attr.min_rnr_timer, 31),
                                   (M.IBV_QP_DEST_QPN, "dest_qp_num", attr.dest_qp_num, 0xFFFFFF),
                                   (M.IBV_QP_QKEY, "qkey", attr.qkey, 0xFFFFFFFF),
                                   (M.IBV_QP_PATH_MIG_STATE, "path_mig_state", attr.path_mig_state, 2)):
            if mask & bit and not 0 <= val <= mx:
                raise PyverbsRDMAError(f"{what}: {name} {val} is outside 0..{mx}", errno.EINVAL)
        if mask & M.IBV_QP_ACCESS_FLAGS and attr.qp_access_flags & ~0x3FF:
            raise PyverbsRDMAError(f"{what}: unknown qp_access_flags bits "
                                   f"0x{attr.qp_access_flags & ~0x3FF:x}", errno.EINVAL)
        # -- everything checked: apply (rxe_qp_from_attr) --------------------------------
        a = self.attr
        if mask & M.IBV_QP_ACCESS_FLAGS:
            a.qp_access_flags = attr.qp_access_flags
        if mask & M.IBV_QP_PKEY_INDEX:
            a.pkey_index = attr.pkey_index
        if mask & M.IBV_QP_PORT:
            a.port_num = attr.port_num
        if mask & M.IBV_QP_QKEY:
            a.qkey = attr.qkey
        if mask & M.IBV_QP_AV:
            a.ah_attr = AHAttr(**attr.ah_attr.__dict__)
            self.av = av
            self.engine.on_av(av)
        if mask & M.IBV_QP_ALT_PATH:
            a.alt_ah_attr = AHAttr(**attr.alt_ah_attr.__dict__)
            a.alt_port_num, a.alt_timeout = attr.alt_port_num, attr.alt_timeout
        if mask & M.IBV_QP_PATH_MTU:
            a.path_mtu = attr.path_mtu
        if mask & M.IBV_QP_TIMEOUT:
            a.timeout = attr.timeout
        if mask & M.IBV_QP_RETRY_CNT:
            a.retry_cnt = attr.retry_cnt
        if mask & M.IBV_QP_RNR_RETRY:
            a.rnr_retry = attr.rnr_retry
        if mask & M.IBV_QP_RQ_PSN:
            a.rq_psn = attr.rq_psn & 0xFFFFFF
            self.engine.set_rq_psn(a.rq_psn)
        if mask & M.IBV_QP_MAX_QP_RD_ATOMIC:
            a.max_rd_atomic = _roundup_pow2(attr.max_rd_atomic)
        if mask & M.IBV_QP_MIN_RNR_TIMER:
            a.min_rnr_timer = attr.min_rnr_timer
        if mask & M.IBV_QP_SQ_PSN:
            a.sq_psn = attr.sq_psn & 0xFFFFFF
            self.engine.set_sq_psn(a.sq_psn)
        if mask & M.IBV_QP_MAX_DEST_RD_ATOMIC:
            a.max_dest_rd_atomic = _roundup_pow2(attr.max_dest_rd_atomic)
            self.engine.on_resp_resources(a.max_dest_rd_atomic)
        if mask & M.IBV_QP_PATH_MIG_STATE:
            a.path_mig_state = attr.path_mig_state
        if mask & M.IBV_QP_DEST_QPN:
            a.dest_qp_num = attr.dest_qp_num
        if mask & M.IBV_QP_EN_SQD_ASYNC_NOTIFY:
            a.en_sqd_async_notify = attr.en_sqd_async_notify
        if mask & M.IBV_QP_STATE:
            self._set_state(S(new))

    def _set_state(self, new: S) -> None:
        old = self.state
        self.state = new
        self.attr.qp_state = self.attr.cur_qp_state = new
        if new == S.IBV_QPS_RESET:
            self.sq.clear()
            if self.srq is None:
                self.rq.clear()
            keep = self.cap
            self.attr = QPAttr(qp_state=new, cur_qp_state=new, path_mtu=ibv_mtu.IBV_MTU_256,
                               cap=keep)
            self.av = None
            self.comm_est_sent = False
            self._last_wqe_sent = False  # a reused QP reports LAST_WQE_REACHED again
            self.engine.reset()
        elif new == S.IBV_QPS_ERR:
            if old != S.IBV_QPS_ERR:
                self.engine.on_error()
            self.flush()
        else:
            self.engine.on_state(old, new)

    def to_error(self) -> None:
        """Move to ERR from inside the data path (a fatal completion, a protocol error)."""
        if self.state not in (S.IBV_QPS_ERR, S.IBV_QPS_RESET):
            self._set_state(S.IBV_QPS_ERR)

    def flush(self) -> None:
        """Complete every outstanding WR with IBV_WC_WR_FLUSH_ERR (the QP is in ERR)."""
        while self.sq:
            w = self.sq.popleft()
            self.send_cq._push(WC(wr_id=w.wr_id, status=ibv_wc_status.IBV_WC_WR_FLUSH_ERR,
                                  opcode=_wc_opcode_of(w.opcode), qp_num=self.qp_num))
        if self.srq is None:
            while self.rq:
                r = self.rq.popleft()
                self.recv_cq._push(WC(wr_id=r.wr_id, status=ibv_wc_status.IBV_WC_WR_FLUSH_ERR,
                                      opcode=0x80, qp_num=self.qp_num))
        elif not getattr(self, "_last_wqe_sent", False):
            self._last_wqe_sent = True
            self.device.emit_async(_async(ibv_event_type.IBV_EVENT_QP_LAST_WQE_REACHED, self))

    def to_init(self, attr: QPAttr) -> None:
        mask = M.IBV_QP_STATE | M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT | (
            M.IBV_QP_QKEY if self.qp_type == T.IBV_QPT_UD else M.IBV_QP_ACCESS_FLAGS)
        attr.qp_state = S.IBV_QPS_INIT
        self.modify(attr, mask)

    def to_rtr(self, attr: QPAttr) -> None:
        if self.state == S.IBV_QPS_RESET:
            self.to_init(attr)
        mask = M.IBV_QP_STATE
        if self.qp_type in (T.IBV_QPT_RC, T.IBV_QPT_UC):
            mask |= M.IBV_QP_AV | M.IBV_QP_PATH_MTU | M.IBV_QP_DEST_QPN | M.IBV_QP_RQ_PSN
        if self.qp_type == T.IBV_QPT_RC:
            mask |= M.IBV_QP_MAX_DEST_RD_ATOMIC | M.IBV_QP_MIN_RNR_TIMER
        attr.qp_state = S.IBV_QPS_RTR
        self.modify(attr, mask)

    def to_rts(self, attr: QPAttr) -> None:
        if self.state in (S.IBV_QPS_RESET, S.IBV_QPS_INIT):
            self.to_rtr(attr)
        mask = M.IBV_QP_STATE | M.IBV_QP_SQ_PSN
        if self.qp_type == T.IBV_QPT_RC:
            mask |= M.IBV_QP_TIMEOUT | M.IBV_QP_RETRY_CNT | M.IBV_QP_RNR_RETRY | \
                M.IBV_QP_MAX_QP_RD_ATOMIC
        attr.qp_state = S.IBV_QPS_RTS
        self.modify(attr, mask)

    def query(self, attr_mask: int = 0) -> tuple[QPAttr, QPInitAttr]:
        """ibv_query_qp: the current attributes and the creation attributes."""
        self._check()
        a = self.attr.copy()
        a.cur_qp_state = a.qp_state = self.state
        a.sq_draining = int(self.sq_draining)
        a.cap = QPCap(**self.cap.__dict__)
        ia = QPInitAttr(qp_type=self.qp_type, qp_context=self.qp_context, scq=self.send_cq,
                        rcq=self.recv_cq, srq=self.srq, cap=QPCap(**self.cap.__dict__),
                        sq_sig_all=int(self.sq_sig_all))
        return a, ia

    # -- posting ---------------------------------------------------------------------
    def post_recv(self, wr: RecvWR | list[RecvWR], bad_wr: RecvWR | None = None) -> None:
        """Post receive WRs (a chain or a list). On failure raises PyverbsRDMAError with
        ``bad_wr`` (and ``bad_wr_index``) naming the first WR not posted; earlier WRs stay
        posted, as with ibv_post_recv."""
        self._check()
        with self.device.lock:
            for i, w in enumerate(_chain(wr)):
                try:
                    if self.srq is not None:
                        raise PyverbsRDMAError("Failed to post receive: the QP uses an SRQ "
                                               "(post to the SRQ)", errno.EINVAL)
                    if self.state == S.IBV_QPS_RESET:
                        raise PyverbsRDMAError("Failed to post receive: the QP is in RESET",
                                               errno.EINVAL)
                    if len(self.rq) >= self.cap.max_recv_wr:
                        raise PyverbsRDMAError(f"Failed to post receive: the receive queue is "
                                               f"full ({self.cap.max_recv_wr})", errno.ENOMEM)
                    wqe = _post_recv_checks(self.device, self.pd, w, self.cap.max_recv_sge, "QP")
                except PyverbsRDMAError as e:
                    _mark_bad(e, w, i, bad_wr)
                    if i and self.state == S.IBV_QPS_ERR:
                        self.flush()  # the WRs before the bad one are posted: flush them too
                    elif i:
                        self.engine.on_recv_posted()
                    raise
                self.rq.append(wqe)
            if self.state == S.IBV_QPS_ERR:
                self.flush()
            else:
                self.engine.on_recv_posted()

    def post_send(self, wr: SendWR | list[SendWR], bad_wr: SendWR | None = None) -> None:
        """Post send WRs (a chain or a list); errors as for :meth:`post_recv`."""
        self._check()
        with self.device.lock:
            for i, w in enumerate(_chain(wr)):
                try:
                    wqe = self._make_send_wqe(w)
                except PyverbsRDMAError as e:
                    _mark_bad(e, w, i, bad_wr)
                    if i and self.state == S.IBV_QPS_ERR:
                        self.flush()  # the WRs before the bad one are posted: flush them too
                    elif i:
                        self.engine.kick()  # ... or start them
                    raise
                self.sq.append(wqe)
            if self.state == S.IBV_QPS_ERR:
                self.flush()
            else:
                self.engine.kick()
            self.device.after_post()

    def _make_send_wqe(self, w: SendWR) -> SendWqe:
        what = "Failed to post send"
        if self.state < S.IBV_QPS_RTS:
            raise PyverbsRDMAError(f"{what}: the QP is in {S(self.state).name}, not RTS",
                                   errno.EINVAL)
        if w.opcode not in _ALLOWED_OPS[self.qp_type]:
            try:
                opname = W(w.opcode).name
            except ValueError:
                opname = str(w.opcode)
            raise PyverbsRDMAError(f"{what}: opcode {opname} is not supported on "
                                   f"{self.qp_type.name.removeprefix('IBV_QPT_')} QPs", errno.EINVAL)
        if len(self.sq) >= self.cap.max_send_wr:
            raise PyverbsRDMAError(f"{what}: the send queue is full ({self.cap.max_send_wr})",
                                   errno.ENOMEM)
        if w.send_flags & ~0x1F:
            raise PyverbsRDMAError(f"{what}: unknown send_flags 0x{w.send_flags & ~0x1F:x}",
                                   errno.EINVAL)
        sges, total = _sges(w, self.cap.max_send_sge, what)
        inline = None
        if w.send_flags & F.IBV_SEND_INLINE and w.opcode in _INLINE_OK:
            if total > self.cap.max_inline_data:
                raise PyverbsRDMAError(f"{what}: {total} bytes of inline data exceed "
                                       f"max_inline_data {self.cap.max_inline_data}", errno.EINVAL)
            inline = self._gather_inline(sges, what)
        if w.opcode in _ATOMIC_OPS:
            if total != 8 or w.remote_addr & 7:
                raise PyverbsRDMAError(f"{what}: an atomic needs one 8-byte local buffer and "
                                       f"an 8-byte aligned remote_addr", errno.EINVAL)
        if w.opcode == W.IBV_WR_BIND_MW and (w.mw is None or w.bind_info is None):
            raise PyverbsRDMAError(f"{what}: BIND_MW needs set_bind_wr(mw, bind_info)", errno.EINVAL)
        if self.qp_type == T.IBV_QPT_UD:
            if w.ah is None or getattr(w.ah, "closed", True):
                raise PyverbsRDMAError(f"{what}: a UD send needs an address handle "
                                       f"(set_wr_ud)", errno.EINVAL)
            if w.ah.pd is not self.pd:
                raise PyverbsRDMAError(f"{what}: the AH belongs to another PD", errno.EINVAL)
            if not 0 <= w.remote_qpn <= 0xFFFFFF:
                raise PyverbsRDMAError(f"{what}: remote_qpn {w.remote_qpn} is not 24-bit",
                                       errno.EINVAL)
        signaled = self.sq_sig_all or bool(w.send_flags & F.IBV_SEND_SIGNALED)
        wqe = SendWqe(w.wr_id, int(w.opcode), int(w.send_flags), signaled, sges, inline, total)
        wqe.imm = w.imm_data & 0xFFFFFFFF
        wqe.remote_addr = w.remote_addr
        wqe.rkey = w.rkey
        wqe.compare_add = w.compare_add
        wqe.swap = w.swap
        if self.qp_type == T.IBV_QPT_UD:
            wqe.av = w.ah.av
            wqe.remote_qpn = w.remote_qpn
            wqe.remote_qkey = w.remote_qkey
        if w.opcode == W.IBV_WR_BIND_MW:
            wqe.mw, wqe.bind_info, wqe.bind_rkey = w.mw, w.bind_info, w.bind_rkey
        return wqe

    def _gather_inline(self, sges: list[tuple[int, int, int]], what: str) -> bytes:
        # Inline data is copied at post time; libibverbs ignores the lkey of inline SGEs, so
        # we accept any registered range (through its lkey, if it names an MR of this PD).
        from ..soft.memory import AccessError
        out = bytearray()
        for addr, length, lkey in sges:
            if not length:
                continue
            try:
                out += self.device.keys.resolve(lkey, self.pd, addr, length, 0, remote=False)
            except AccessError as e:
                raise PyverbsRDMAError(f"{what}: inline SGE [0x{addr:x}, +{length}): {e}",
                                       errno.EINVAL) from None
        return bytes(out)

    def bind_mw(self, mw: Any, mw_bind: Any) -> None:
        """ibv_bind_mw for a type 1 window: posts a bind WR; on success ``mw.rkey`` is the
        new rkey once the bind completes (IBV_WC_BIND_MW)."""
        self._check()
        if mw.mw_type != 1:
            raise PyverbsRDMAError("Failed to bind MW: use an IBV_WR_BIND_MW work request for "
                                   "type 2 windows", errno.EINVAL)
        wr = SendWR(wr_id=mw_bind.wr_id, opcode=W.IBV_WR_BIND_MW, send_flags=mw_bind.send_flags)
        new_key = (mw.rkey & ~0xFF) | ((mw.rkey + 1) & 0xFF)  # ibv_inc_rkey
        wr.set_bind_wr(mw, mw_bind.bind_info, new_key)
        self.post_send(wr)

    # -- destroy ----------------------------------------------------------------------
    def _destroy(self) -> None:
        if not self.closed:
            with self.device.lock:
                self.engine.destroy()
                self.device.qps.pop(self.qp_num, None)
                self._release(self.pd, self.send_cq, self.recv_cq, self.srq)
        super()._destroy()

    def __repr__(self) -> str:
        return f"<QP {self.qp_type.name.removeprefix('IBV_QPT_')} 0x{self.qp_num:x} {S(self.state).name}>"


def _mark_bad(e: PyverbsRDMAError, w: Any, i: int, bad_wr: Any) -> None:
    e.bad_wr = w  # type: ignore[attr-defined]
    e.bad_wr_index = i  # type: ignore[attr-defined]
    if bad_wr is not None:
        bad_wr.__dict__.update(w.__dict__)


def _roundup_pow2(n: int) -> int:
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


_WC_OF_WR = {W.IBV_WR_RDMA_WRITE: 1, W.IBV_WR_RDMA_WRITE_WITH_IMM: 1, W.IBV_WR_SEND: 0,
             W.IBV_WR_SEND_WITH_IMM: 0, W.IBV_WR_SEND_WITH_INV: 0, W.IBV_WR_RDMA_READ: 2,
             W.IBV_WR_ATOMIC_CMP_AND_SWP: 3, W.IBV_WR_ATOMIC_FETCH_AND_ADD: 4,
             W.IBV_WR_BIND_MW: 5, W.IBV_WR_LOCAL_INV: 6}


def _wc_opcode_of(wr_opcode: int) -> int:
    return _WC_OF_WR.get(wr_opcode, 0)
