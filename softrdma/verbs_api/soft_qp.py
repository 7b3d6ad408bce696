"""``SoftQP``: the soft backend's queue pair, behind :class:`softrdma.verbs_api.QP`.

The API object (``verbs_api.QP``) checks what both backends check and holds one of these,
chosen by the context it is made in (``context.backend.QP``). This class is rxe's
``rxe_verbs.c`` over an ``rxe_qp``: it owns the protocol engine
(:class:`softrdma.qp.engine.QpEngine`), applies the kernel's transition table and rxe's
attribute checks in :meth:`modify` (all or nothing), and turns work requests into WQEs on
the engine's queues. What only this backend has (``engine``, ``sq``, ``rq``, ``av``) is
listed in :attr:`SoftQP.extras`; the API object forwards those names and no others, so
they are absent, not broken, on a hardware QP.
"""

from __future__ import annotations

import errno
import os
from collections import deque
from typing import Any

from ..errors import PyverbsRDMAError
from ..qp.engine import QpEngine
from ..qp.memory import AccessError
from ..qp.mw import BindRequest
from ..qp.transitions import check_transition
from ..qp.wqe import RecvWqe, SendWqe
from ..wire.trains import MAX_SEGMENTS
from ._check import U8, U16, U24, U32, U64, as_bits, as_flag, as_int, require
from .ah import AH, AddressVector, resolve_av
from .attr import AHAttr, QPAttr, QPCap
from .cq import ring_size
from .enums import (
    ibv_mtu, ibv_qp_attr_mask as M, ibv_qp_state as S, ibv_qp_type as T,
    ibv_send_flags as F, ibv_wr_opcode as W,
)
from .mr import MR, MR_ACCESS_BITS, MW
from .posting import (
    MAX_MSG, check_send_scalars, check_wr_arg, mark_bad, recv_wqe, sge_list, wr_chain,
)
from .qp import check_cap
from .wr import SGE, MWBindInfo, RecvWR, SendWR

__all__ = ["SoftQP"]

# Work request opcodes each QP type accepts (rxe_wr_opcode_info of the 6.12 kernel: FLUSH
# and ATOMIC WRITE, since 6.2, on RC only).
_ALLOWED_OPS = {
    T.IBV_QPT_RC: {W.IBV_WR_RDMA_WRITE, W.IBV_WR_RDMA_WRITE_WITH_IMM, W.IBV_WR_SEND,
                   W.IBV_WR_SEND_WITH_IMM, W.IBV_WR_RDMA_READ, W.IBV_WR_ATOMIC_CMP_AND_SWP,
                   W.IBV_WR_ATOMIC_FETCH_AND_ADD, W.IBV_WR_LOCAL_INV, W.IBV_WR_BIND_MW,
                   W.IBV_WR_SEND_WITH_INV, W.IBV_WR_FLUSH, W.IBV_WR_ATOMIC_WRITE},
    T.IBV_QPT_UC: {W.IBV_WR_RDMA_WRITE, W.IBV_WR_RDMA_WRITE_WITH_IMM, W.IBV_WR_SEND,
                   W.IBV_WR_SEND_WITH_IMM, W.IBV_WR_LOCAL_INV, W.IBV_WR_BIND_MW,
                   W.IBV_WR_SEND_WITH_INV},
    T.IBV_QPT_UD: {W.IBV_WR_SEND, W.IBV_WR_SEND_WITH_IMM},
}
_ATOMIC_OPS = {W.IBV_WR_ATOMIC_CMP_AND_SWP, W.IBV_WR_ATOMIC_FETCH_AND_ADD}
_INLINE_OK = {W.IBV_WR_RDMA_WRITE, W.IBV_WR_RDMA_WRITE_WITH_IMM, W.IBV_WR_SEND,
              W.IBV_WR_SEND_WITH_IMM, W.IBV_WR_SEND_WITH_INV}
# the opcodes of the one-SGE fast path in _make_send_wqe (SOFTRDMA_SMALL_MSG)
_PLAIN_OPS = frozenset(int(o) for o in (W.IBV_WR_RDMA_WRITE, W.IBV_WR_RDMA_WRITE_WITH_IMM,
                                        W.IBV_WR_SEND, W.IBV_WR_SEND_WITH_IMM))
_SGE_SIZE = 16  # sizeof(struct ib_sge): rxe sizes the send WQE by SGEs or inline bytes
_SEND_FLAGS = 0x1F  # FENCE | SIGNALED | SOLICITED | INLINE | IP_CSUM
_INLINE, _SIGNALED = int(F.IBV_SEND_INLINE), int(F.IBV_SEND_SIGNALED)  # plain ints: per WR
# tested for every WR posted: plain values (an enum member lookup costs each time)
_OP_ATOMIC_WRITE, _OP_FLUSH, _OP_BIND_MW = (int(W.IBV_WR_ATOMIC_WRITE), int(W.IBV_WR_FLUSH),
                                            int(W.IBV_WR_BIND_MW))
_RTS, _UD = int(S.IBV_QPS_RTS), T.IBV_QPT_UD
# the types a WR's scalar fields take on the fast path (anything else: the named checks)
_INT_TYPES = frozenset({int, W, F})
_QP_ACCESS = 0x3FF  # the ibv_access_flags bits a QP's qp_access_flags may carry
_QPS_RESET, _QPS_ERR = int(S.IBV_QPS_RESET), int(S.IBV_QPS_ERR)  # plain ints: cheap compares
#: one WR per post without the chain walk (:meth:`SoftQP._post_one`, ``_post_recv_one``);
#: SOFTRDMA_SMALL_MSG=0: off
SMALL_MSG = os.environ.get("SOFTRDMA_SMALL_MSG", "1").strip().lower() not in (
    "0", "no", "off", "false")
#: packets a post may leave queued (doorbell batching): one full train (UDP GSO segments)
DOORBELL_BATCH = int(os.environ.get("SOFTRDMA_DOORBELL_BATCH", MAX_SEGMENTS))


# attr_mask bit -> the QPAttr fields it makes modify read, with their C widths; checked
# (type and width) before any rule of the transition table or rxe's value checks runs.
_MASKED_FIELDS: tuple[tuple[int, tuple[tuple[str, int], ...]], ...] = (
    (M.IBV_QP_STATE, (("qp_state", U32),)),
    (M.IBV_QP_CUR_STATE, (("cur_qp_state", U32),)),
    (M.IBV_QP_PKEY_INDEX, (("pkey_index", U16),)),
    (M.IBV_QP_PORT, (("port_num", U8),)),
    (M.IBV_QP_QKEY, (("qkey", U32),)),
    (M.IBV_QP_PATH_MTU, (("path_mtu", U32),)),
    (M.IBV_QP_TIMEOUT, (("timeout", U8),)),
    (M.IBV_QP_RETRY_CNT, (("retry_cnt", U8),)),
    (M.IBV_QP_RNR_RETRY, (("rnr_retry", U8),)),
    (M.IBV_QP_RQ_PSN, (("rq_psn", U24),)),
    (M.IBV_QP_MAX_QP_RD_ATOMIC, (("max_rd_atomic", U8),)),
    (M.IBV_QP_ALT_PATH, (("alt_port_num", U8), ("alt_timeout", U8), ("alt_pkey_index", U16))),
    (M.IBV_QP_MIN_RNR_TIMER, (("min_rnr_timer", U8),)),
    (M.IBV_QP_SQ_PSN, (("sq_psn", U24),)),
    (M.IBV_QP_MAX_DEST_RD_ATOMIC, (("max_dest_rd_atomic", U8),)),
    (M.IBV_QP_PATH_MIG_STATE, (("path_mig_state", U32),)),
    (M.IBV_QP_DEST_QPN, (("dest_qp_num", U24),)),
    (M.IBV_QP_RATE_LIMIT, (("rate_limit", U32),)),
)


# attr_mask bits whose QPAttr field is copied as it is (the others need more: see SoftQP._modify)
_PLAIN_ATTRS = ((M.IBV_QP_ACCESS_FLAGS, "qp_access_flags"), (M.IBV_QP_PKEY_INDEX, "pkey_index"),
                (M.IBV_QP_PORT, "port_num"), (M.IBV_QP_QKEY, "qkey"),
                (M.IBV_QP_PATH_MTU, "path_mtu"), (M.IBV_QP_TIMEOUT, "timeout"),
                (M.IBV_QP_RETRY_CNT, "retry_cnt"), (M.IBV_QP_RNR_RETRY, "rnr_retry"),
                (M.IBV_QP_RQ_PSN, "rq_psn"), (M.IBV_QP_MIN_RNR_TIMER, "min_rnr_timer"),
                (M.IBV_QP_SQ_PSN, "sq_psn"), (M.IBV_QP_PATH_MIG_STATE, "path_mig_state"),
                (M.IBV_QP_DEST_QPN, "dest_qp_num"),
                (M.IBV_QP_EN_SQD_ASYNC_NOTIFY, "en_sqd_async_notify"))


class SoftQP:
    """A QP on a soft device: its engine, and the verbs that translate into it."""

    #: the members only the soft backend has, reachable through the API object
    extras = frozenset({"engine", "sq", "rq", "av"})

    @staticmethod
    def check_create(pd: Any, qpt: int, cap: QPCap, srq: Any, what: str) -> None:
        """What rxe refuses at ``create_qp`` (rxe_qp_chk_init and rxe_qp_chk_cap), before
        anything is allocated."""
        if qpt not in _ALLOWED_OPS:
            raise PyverbsRDMAError(f"{what}: qp_type {qpt} is not supported (RC, UC, UD)",
                                   errno.EOPNOTSUPP if qpt in T._value2member_map_ else errno.EINVAL)
        lim = pd.device.limits
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

    def __init__(self, owner: Any, pd: Any, qpt: int, cap: QPCap, scq: Any, rcq: Any,
                 srq: Any, sq_sig_all: bool) -> None:
        """Allocate the QP number and the engine (the caller holds the device lock);
        ``owner`` is the API object, the QP that async events name."""
        dev = self.device = pd.device
        self.pd = pd
        self.srq = srq
        self.sq_sig_all = sq_sig_all
        self.qp_type = T(qpt)
        self.qp_num = qpn = dev.alloc_qpn()
        # Sizes as rxe reports them back (rxe_qp_init_req / init_resp)
        wqe_size = max(cap.max_send_sge * _SGE_SIZE, cap.max_inline_data)
        self.cap = QPCap(max_send_wr=ring_size(cap.max_send_wr),
                         max_recv_wr=0 if srq else ring_size(cap.max_recv_wr),
                         max_send_sge=wqe_size // _SGE_SIZE,
                         max_recv_sge=0 if srq else cap.max_recv_sge,
                         max_inline_data=wqe_size)
        # the protocol state lives in the engine (rxe_qp); this object translates
        # the engine pushes to the CQs' implementations (SoftCQ.push) and takes receives
        # from the SRQ's (SoftSRQ.take): the sinks and source of qp/interfaces.py
        self.engine = QpEngine(dev, qpn, self.qp_type, pd, scq.impl, rcq.impl,
                               None if srq is None else srq.impl, self._fresh_attr(), owner=owner)
        dev.qps[qpn] = self.engine

    def _fresh_attr(self) -> QPAttr:
        """The attributes of a QP in RESET (rxe_qp_init / after a move to RESET)."""
        return QPAttr(qp_state=S.IBV_QPS_RESET, cur_qp_state=S.IBV_QPS_RESET,
                      path_mtu=ibv_mtu.IBV_MTU_256, cap=self.cap)

    # -- the engine's state --------------------------------------------------------------
    @property
    def state(self) -> int:
        return self.engine.state

    @property
    def attr(self) -> QPAttr:
        return self.engine.attr  # type: ignore[return-value]

    @property
    def av(self) -> AddressVector | None:
        return self.engine.av

    @property
    def sq(self) -> "deque[SendWqe]":
        return self.engine.sq

    @property
    def rq(self) -> "deque[RecvWqe]":
        return self.engine.rq

    @property
    def sq_draining(self) -> bool:
        return self.engine.sq_draining

    @property
    def duplicate_requests(self) -> int:
        """Duplicate requests the responder answered (re-ACKed or re-executed reads and
        atomics): the sign of a lost ACK or a retransmission."""
        return self.engine.resp.duplicates

    # -- modify --------------------------------------------------------------------------
    def modify(self, attr: QPAttr, attr_mask: int) -> None:
        what = "Failed to modify QP"
        require(attr, QPAttr, what, "attr")
        mask = as_int(attr_mask, what, "attr_mask", U64, desc="not an attribute mask")
        with self.device.lock:
            self._modify(attr, mask)
            self.device.after_post()  # a move to RTS may have sent queued work

    def _modify(self, attr: QPAttr, mask: int) -> None:
        what = "Failed to modify QP"
        # Types and C widths of every attribute the mask names, before any rule reads them
        # (unknown mask bits are refused by check_transition, with EOPNOTSUPP as uverbs).
        for bit, fields in _MASKED_FIELDS:
            if mask & bit:
                for name, hi in fields:
                    as_int(getattr(attr, name), what, f"attr.{name}", hi)
        if mask & M.IBV_QP_EN_SQD_ASYNC_NOTIFY:
            as_flag(attr.en_sqd_async_notify, what, "attr.en_sqd_async_notify")
        if mask & M.IBV_QP_ACCESS_FLAGS:
            as_bits(attr.qp_access_flags, what, "attr.qp_access_flags", _QP_ACCESS,
                    noun="access flags")
        if mask & M.IBV_QP_CAP:
            check_cap(attr.cap, what, "attr.cap")
        cur = attr.cur_qp_state if mask & M.IBV_QP_CUR_STATE else self.state
        new = attr.qp_state if mask & M.IBV_QP_STATE else cur
        for name, val in (("qp_state", new), ("cur_qp_state", cur)):
            if val not in S._value2member_map_ or val == S.IBV_QPS_UNKNOWN:
                raise PyverbsRDMAError(f"{what}: attr.{name} {val} is not a QP state", errno.EINVAL)
        if mask & M.IBV_QP_CUR_STATE and cur != self.state:
            # rxe trusts cur_qp_state only as a hint that must agree with the real state
            raise PyverbsRDMAError(f"{what}: attr.cur_qp_state {S(cur).name} does not match the QP "
                                   f"state {S(self.state).name}", errno.EINVAL)
        check_transition(cur, new, self.qp_type, mask)
        # rxe_qp_chk_attr
        if self.state == S.IBV_QPS_SQD and mask & M.IBV_QP_STATE and new != S.IBV_QPS_ERR \
                and self.sq_draining:
            raise PyverbsRDMAError(f"{what}: the send queue is still draining", errno.EINVAL)
        lim = self.device.limits
        if mask & M.IBV_QP_PORT and attr.port_num != 1:
            raise PyverbsRDMAError(f"{what}: attr.port_num {attr.port_num} is not 1", errno.EINVAL)
        if mask & M.IBV_QP_PKEY_INDEX and not 0 <= attr.pkey_index < lim.max_pkeys:
            raise PyverbsRDMAError(f"{what}: attr.pkey_index {attr.pkey_index} is outside "
                                   f"0..{lim.max_pkeys - 1}", errno.EINVAL)
        av = None
        if mask & M.IBV_QP_AV:
            av = resolve_av(self.device, attr.ah_attr, what, "attr.ah_attr")
        if mask & M.IBV_QP_ALT_PATH:
            resolve_av(self.device, attr.alt_ah_attr, what, "attr.alt_ah_attr")
            if attr.alt_port_num != 1:
                raise PyverbsRDMAError(f"{what}: attr.alt_port_num {attr.alt_port_num} is not 1",
                                       errno.EINVAL)
            if attr.alt_timeout > 31:
                raise PyverbsRDMAError(f"{what}: attr.alt_timeout {attr.alt_timeout} > 31", errno.EINVAL)
        if mask & M.IBV_QP_PATH_MTU and not ibv_mtu.IBV_MTU_256 <= attr.path_mtu <= self.device.max_mtu:
            raise PyverbsRDMAError(f"{what}: attr.path_mtu {attr.path_mtu} is not an IBV_MTU_* value "
                                   f"up to the port's max_mtu", errno.EINVAL)
        if mask & M.IBV_QP_MAX_QP_RD_ATOMIC and not 0 <= attr.max_rd_atomic <= lim.max_qp_init_rd_atom:
            raise PyverbsRDMAError(f"{what}: attr.max_rd_atomic {attr.max_rd_atomic} exceeds "
                                   f"{lim.max_qp_init_rd_atom}", errno.EINVAL)
        if mask & M.IBV_QP_MAX_DEST_RD_ATOMIC and not 0 <= attr.max_dest_rd_atomic <= lim.max_qp_rd_atom:
            raise PyverbsRDMAError(f"{what}: attr.max_dest_rd_atomic {attr.max_dest_rd_atomic} "
                                   f"exceeds {lim.max_qp_rd_atom}", errno.EINVAL)
        for bit, name, val, mx in ((M.IBV_QP_TIMEOUT, "timeout", attr.timeout, 31),
                                   (M.IBV_QP_RETRY_CNT, "retry_cnt", attr.retry_cnt, 7),
                                   (M.IBV_QP_RNR_RETRY, "rnr_retry", attr.rnr_retry, 7),
                                   (M.IBV_QP_MIN_RNR_TIMER, "min_rnr_timer", attr.min_rnr_timer, 31),
                                   (M.IBV_QP_DEST_QPN, "dest_qp_num", attr.dest_qp_num, 0xFFFFFF),
                                   (M.IBV_QP_QKEY, "qkey", attr.qkey, 0xFFFFFFFF),
                                   (M.IBV_QP_PATH_MIG_STATE, "path_mig_state", attr.path_mig_state, 2)):
            if mask & bit and not 0 <= val <= mx:
                raise PyverbsRDMAError(f"{what}: attr.{name} {val} is outside 0..{mx}", errno.EINVAL)
        if mask & M.IBV_QP_ACCESS_FLAGS and attr.qp_access_flags & ~0x3FF:
            raise PyverbsRDMAError(f"{what}: unknown qp_access_flags bits "
                                   f"0x{attr.qp_access_flags & ~0x3FF:x}", errno.EINVAL)
        # -- everything checked: apply (rxe_qp_from_attr) --------------------------------
        a = self.attr
        eng = self.engine
        for bit, name in _PLAIN_ATTRS:
            if mask & bit:
                setattr(a, name, int(getattr(attr, name)))
        if mask & M.IBV_QP_AV:
            a.ah_attr = AHAttr(**attr.ah_attr.__dict__)
            eng.set_av(av)
        if mask & M.IBV_QP_ALT_PATH:
            a.alt_ah_attr = AHAttr(**attr.alt_ah_attr.__dict__)
            a.alt_port_num, a.alt_timeout = int(attr.alt_port_num), int(attr.alt_timeout)
        if mask & M.IBV_QP_RQ_PSN:
            eng.set_rq_psn(a.rq_psn)
        if mask & M.IBV_QP_SQ_PSN:
            eng.set_sq_psn(a.sq_psn)
        if mask & M.IBV_QP_MAX_QP_RD_ATOMIC:  # rxe rounds both up to a power of two
            a.max_rd_atomic = _roundup_pow2(int(attr.max_rd_atomic))
        if mask & M.IBV_QP_MAX_DEST_RD_ATOMIC:
            a.max_dest_rd_atomic = _roundup_pow2(int(attr.max_dest_rd_atomic))
            eng.set_resp_resources(a.max_dest_rd_atomic)
        if mask & M.IBV_QP_STATE:
            self.engine.set_state(S(new), self._fresh_attr() if new == S.IBV_QPS_RESET else None)

    def to_error(self) -> None:
        """Move to ERR, completing everything outstanding with IBV_WC_WR_FLUSH_ERR."""
        self.engine.to_error()

    def flush(self) -> None:
        self.engine.flush()

    def query(self, attr_mask: int = 0) -> tuple[QPAttr, QPCap, int]:
        """The current attributes, the granted capabilities and ``sq_sig_all`` (rxe
        answers every attribute whatever the mask)."""
        a = self.attr.copy()
        a.cur_qp_state = a.qp_state = self.state
        a.sq_draining = int(self.sq_draining)
        a.cap = QPCap(**self.cap.__dict__)
        return a, QPCap(**self.cap.__dict__), int(self.sq_sig_all)

    # -- posting ---------------------------------------------------------------------
    def post_recv(self, wr: RecvWR | list[RecvWR], bad_wr: RecvWR | None = None) -> None:
        """Post receive WRs (a chain or a list). On failure raises PyverbsRDMAError with
        ``bad_wr`` (and ``bad_wr_index``) naming the first WR not posted; earlier WRs stay
        posted, as with ibv_post_recv. Every field is checked before the WR is queued."""
        if type(wr) is RecvWR and wr.next_wr is None and bad_wr is None and SMALL_MSG and \
                self.device.trace is None and self._post_recv_one(wr):
            return
        check_wr_arg(wr, bad_wr, RecvWR, "Failed to post receive")
        with self.device.lock:
            for i, w in enumerate(wr_chain(wr)):
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
                    wqe = recv_wqe(self.device, self.pd, w, self.cap.max_recv_sge,
                                            "QP", i)
                except PyverbsRDMAError as e:
                    mark_bad(e, w, i, bad_wr)
                    if i and self.state == S.IBV_QPS_ERR:
                        self.flush()  # the WRs before the bad one are posted: flush them too
                    raise
                self.rq.append(wqe)
                if self.device.trace is not None:
                    self.engine.trace("wqe", f"post_recv wr_id={wqe.wr_id} "
                                             f"len={wqe.length}", queue="rq",
                                      wr_id=wqe.wr_id, len=wqe.length)
            if self.state == S.IBV_QPS_ERR:
                self.flush()

    def _post_recv_one(self, w: RecvWR) -> bool:
        """:meth:`post_recv` of one plain WR (an int ``wr_id``, at most one SGE of plain
        ints, in range) to a QP that takes it: queued, True. Anything else -- another
        shape, a value to check by name, an error to report -- is left to the general
        path (False, nothing done), which checks and reports exactly as before. A latency
        loop reposts a receive per message (perftest's ib_send_lat before its SEND)."""
        wr_id = w.wr_id
        if type(wr_id) is not int or not 0 <= wr_id <= U64:
            return False
        sg = w.sg_list
        n = w.num_sge
        if type(sg) is not list or type(n) is not int or n > 1 or n > len(sg) or \
                n > self.cap.max_recv_sge:
            return False
        if n:
            s = sg[0]
            if type(s) is not SGE:
                return False
            addr, length, lkey = s.addr, s.length, s.lkey
            if not (type(addr) is int and type(length) is int and type(lkey) is int
                    and 0 <= addr <= U64 and 0 <= length <= U32
                    and 0 <= lkey <= U32 and length <= MAX_MSG):
                return False
            wqe = RecvWqe(wr_id, [(addr, length, lkey)], length)
        else:
            wqe = RecvWqe(wr_id, [], 0)
        with self.device.lock:
            st = self.state
            if self.srq is not None or st == _QPS_RESET or st == _QPS_ERR \
                    or len(self.rq) >= self.cap.max_recv_wr:
                return False  # the general path says why, or flushes in ERR
            self.rq.append(wqe)
        return True

    def post_send(self, wr: SendWR | list[SendWR], bad_wr: SendWR | None = None) -> None:
        """Post send WRs (a chain or a list); errors as for :meth:`post_recv`.

        Every field of every WR is checked here, before it is queued (types, C widths,
        known flag bits, object classes; see :mod:`softrdma.verbs_api._check`): a WR the
        engines accept can no longer fail in a way that escapes its QP."""
        dev = self.device
        if type(wr) is SendWR and wr.next_wr is None and bad_wr is None and SMALL_MSG and \
                dev.trace is None:
            self._post_one(wr)
            return
        check_wr_arg(wr, bad_wr, SendWR, "Failed to post send")
        with dev.lock:
            busy = len(self.sq)  # WQEs this post finds queued or in flight
            for i, w in enumerate(wr_chain(wr)):
                try:
                    wqe = self._make_send_wqe(w, i)
                except PyverbsRDMAError as e:
                    mark_bad(e, w, i, bad_wr)
                    if i and self.state == S.IBV_QPS_ERR:
                        self.flush()  # the WRs before the bad one are posted: flush them too
                    elif i:
                        self.engine.kick()  # ... or start them
                    raise
                self.sq.append(wqe)
                if self.device.trace is not None:
                    self.engine.trace("wqe", f"post_send {W(wqe.opcode).name[7:]} "
                                             f"wr_id={wqe.wr_id} len={wqe.length}"
                                             f"{' signaled' if wqe.signaled else ''}",
                                      queue="sq", wr_id=wqe.wr_id, len=wqe.length,
                                      opcode=W(wqe.opcode).name)
            if self.state == S.IBV_QPS_ERR:
                self.flush()
            else:
                self.engine.kick()
            dev.after_post()
            if dev.udp is not None:
                # Doorbell batching (softrdma.soft.lock): if the QP was already busy, its
                # packets may wait for the next flush (the next poll, or the progress
                # thread's pass, which this wakes) and leave with those of the posts after
                # it, as one train. A post to an idle QP goes at once, as rxe runs its
                # requester inline for a lone WQE: a latency-bound program pays nothing.
                # Nor do more than a train's worth wait (DOORBELL_BATCH): the peer starts
                # on a full train while the program posts the next. A packet holding a
                # view of the MR (zero copy) leaves within this hold, as its ICRC assumes
                # (docs/wire.md, "Zero copy").
                udp = dev.udp
                n = udp.pending
                dev.lock.ring(busy > 0 and 0 < n < DOORBELL_BATCH and not udp.views_pending)

    def _post_one(self, w: SendWR) -> None:
        """:meth:`post_send` of one WR (no chain, no ``bad_wr``, no trace): perftest's
        message-rate loop. The same checks (:meth:`_make_send_wqe`), queueing, kick and
        doorbell, without walking a chain (SOFTRDMA_SMALL_MSG=0: the general loop)."""
        dev = self.device
        with dev.lock:
            sq = self.sq
            busy = len(sq)
            try:
                wqe = self._make_send_wqe(w, 0)
            except PyverbsRDMAError as e:
                mark_bad(e, w, 0, None)
                raise
            sq.append(wqe)
            if self.state == S.IBV_QPS_ERR:
                self.flush()
            else:
                self.engine.kick()
            dev.after_post()
            udp = dev.udp
            if udp is not None:
                n = udp.pending  # the doorbell, as in post_send
                dev.lock.ring(busy > 0 and 0 < n < DOORBELL_BATCH and not udp.views_pending)

    def _make_send_wqe(self, w: Any, i: int = 0) -> SendWqe:
        what = "Failed to post send"
        f = f"wr[{i}]"
        if type(w) is not SendWR:
            require(w, SendWR, what, f)
        if self.engine.state < _RTS:
            raise PyverbsRDMAError(f"{what}: the QP is in {S(self.state).name}, not RTS",
                                   errno.EINVAL)
        # The C widths of every scalar field, whatever the opcode (the packet builder packs
        # them into fixed-width headers: an out-of-range value must never get that far).
        # Fast path: all plain ints in range; otherwise the named checks say which is wrong.
        scalars = (w.opcode, w.send_flags, w.wr_id, w.imm_data, w.remote_addr, w.rkey,
                   w.compare_add, w.swap)
        opcode, send_flags, wr_id, imm, remote_addr, rkey, compare_add, swap = scalars
        if _INT_TYPES.issuperset(map(type, scalars)) and 0 <= opcode <= U32 and \
                0 <= send_flags <= _SEND_FLAGS and 0 <= wr_id <= U64 and 0 <= imm <= U32 and \
                0 <= remote_addr <= U64 and 0 <= rkey <= U32 and 0 <= compare_add <= U64 and \
                0 <= swap <= U64:
            # plain ints from here on (an IntEnum opcode or flag costs a call per test)
            opcode, send_flags = int(opcode), int(send_flags)
        else:
            opcode, send_flags, wr_id, imm, remote_addr, rkey, compare_add, swap = \
                check_send_scalars(w, what, f)
        if opcode not in _ALLOWED_OPS[self.qp_type]:
            try:
                opname = W(opcode).name
            except ValueError:
                opname = str(opcode)
            raise PyverbsRDMAError(f"{what}: {f}.opcode {opname} is not supported on "
                                   f"{self.qp_type.name.removeprefix('IBV_QPT_')} QPs", errno.EINVAL)
        cap = self.cap
        if len(self.engine.sq) >= cap.max_send_wr:
            raise PyverbsRDMAError(f"{what}: the send queue is full ({cap.max_send_wr})",
                                   errno.ENOMEM)
        if SMALL_MSG and opcode in _PLAIN_OPS and not send_flags & _INLINE and \
                self.qp_type is not _UD:
            # a SEND or WRITE from one plain SGE (perftest's shape): sge_list's checks on
            # it inline, and nothing else applies (no inline data, atomics, FLUSH, BIND, AH)
            sg = w.sg_list
            n = w.num_sge
            if type(sg) is list and len(sg) == 1 and type(n) is int and n == 1 and \
                    cap.max_send_sge >= 1 and type(sg[0]) is SGE:
                s = sg[0]
                addr, length, lkey = s.addr, s.length, s.lkey
                if type(addr) is int and type(length) is int and type(lkey) is int and \
                        0 <= addr <= U64 and 0 <= length <= MAX_MSG and 0 <= lkey <= U32:
                    wqe = SendWqe(wr_id, opcode, send_flags,
                                  self.sq_sig_all or bool(send_flags & _SIGNALED),
                                  [(addr, length, lkey)], None, length)
                    wqe.imm = imm
                    wqe.remote_addr = remote_addr
                    wqe.rkey = rkey
                    wqe.compare_add = compare_add
                    wqe.swap = swap
                    return wqe
        sges, total = sge_list(w, cap.max_send_sge, what, f)
        inline = None
        data = getattr(w, "inline_data", None)
        if data is not None and send_flags & _INLINE and opcode in _INLINE_OK:
            # bytes given with the WR (ibv_wr_set_inline_data), no SGE to read them from
            inline, sges = bytes(data), []
            total = len(inline)
            if total > self.cap.max_inline_data:
                raise PyverbsRDMAError(f"{what}: {total} bytes of inline data exceed "
                                       f"max_inline_data {self.cap.max_inline_data}", errno.EINVAL)
        elif send_flags & _INLINE and opcode in _INLINE_OK:
            if total > self.cap.max_inline_data:
                raise PyverbsRDMAError(f"{what}: {total} bytes of inline data exceed "
                                       f"max_inline_data {self.cap.max_inline_data}", errno.EINVAL)
            inline = self._gather_inline(sges, what)
        if opcode in _ATOMIC_OPS:
            if total != 8 or remote_addr & 7:
                raise PyverbsRDMAError(f"{what}: an atomic needs one 8-byte local buffer and "
                                       f"an 8-byte aligned remote_addr", errno.EINVAL)
        if opcode == _OP_ATOMIC_WRITE:
            # the 8 bytes travel in the WQE (librxe's wqe->dma.atomic_wr), from atomic_wr
            # or from one 8-byte local buffer; the responder checks the alignment
            inline, sges, total = self._atomic_write_data(w, sges, total, what, f)
        elif opcode == _OP_FLUSH:
            # no data: the length is the RETH's (librxe: wqe->dma.length)
            sges, inline = [], None
            total = as_int(getattr(w, "flush_length", 0), what, f"{f}.flush_length", U32,
                           desc="not a 32-bit length")
            flush_type = as_int(getattr(w, "flush_type", 0), what, f"{f}.flush_type", U8)
            flush_level = as_int(getattr(w, "flush_level", 0), what, f"{f}.flush_level", U8)
        if opcode == _OP_BIND_MW:
            bind_rkey = self._check_bind(w, what, f)
        ud = self.qp_type == _UD
        if ud:
            if w.ah is None or getattr(w.ah, "closed", True):
                raise PyverbsRDMAError(f"{what}: a UD send needs an address handle "
                                       f"({f}.ah, set by set_wr_ud)", errno.EINVAL)
            require(w.ah, AH, what, f"{f}.ah")
            if w.ah.pd is not self.pd:
                raise PyverbsRDMAError(f"{what}: {f}.ah belongs to another PD", errno.EINVAL)
            remote_qpn = as_int(w.remote_qpn, what, f"{f}.remote_qpn", U24,
                                desc="not a 24-bit QP number")
            remote_qkey = as_int(w.remote_qkey, what, f"{f}.remote_qkey", U32)
        signaled = self.sq_sig_all or bool(send_flags & _SIGNALED)
        wqe = SendWqe(wr_id, opcode, send_flags, signaled, sges, inline, total)
        wqe.imm = imm
        wqe.remote_addr = remote_addr
        wqe.rkey = rkey
        wqe.compare_add = compare_add
        wqe.swap = swap
        if opcode == _OP_FLUSH:
            wqe.flush_type, wqe.flush_level = flush_type, flush_level
        if ud:
            wqe.av = w.ah.impl.av
            wqe.remote_qpn = remote_qpn
            wqe.remote_qkey = remote_qkey
        if opcode == _OP_BIND_MW:
            # the engine works on key-table entries; a window or MR closed before the bind
            # executes is no longer held by the table, and the bind fails (MW_BIND_ERR)
            info = w.bind_info
            wqe.mw = w.mw.impl.entry
            wqe.bind_info = BindRequest(None if info.mr is None else info.mr.impl.entry,
                                        int(info.addr), int(info.length),
                                        int(info.mw_access_flags))
            wqe.bind_rkey = bind_rkey
        return wqe

    def _atomic_write_data(self, w: Any, sges: list[tuple[int, int, int]], total: int,
                           what: str, f: str) -> tuple[bytes, list, int]:
        """An ATOMIC WRITE's 8 bytes: ``w.atomic_wr`` (set_wr_atomic_write), else the one
        8-byte local buffer its SGEs name."""
        data = getattr(w, "atomic_wr", None)
        if data is None:
            if total != 8:
                raise PyverbsRDMAError(f"{what}: {f}: an ATOMIC WRITE needs 8 bytes "
                                       f"(set_wr_atomic_write, or SGEs of 8 bytes)",
                                       errno.EINVAL)
            data = self._gather_inline(sges, what)
        try:
            data = bytes(data)
        except TypeError:
            raise PyverbsRDMAError(f"{what}: {f}.atomic_wr must be bytes, not "
                                   f"{type(data).__name__}", errno.EINVAL) from None
        if len(data) < 8:
            raise PyverbsRDMAError(f"{what}: {f}.atomic_wr has {len(data)} bytes, not 8",
                                   errno.EINVAL)
        return data[:8], [], 8

    @staticmethod
    def _check_bind(w: SendWR, what: str, f: str) -> int:
        """A BIND_MW WR's window, bind info and new rkey (set_bind_wr). Whether the bind is
        allowed (PD, MR rights, range) is decided when it executes, as rxe does: a
        completion with IBV_WC_MW_BIND_ERR."""
        if w.mw is None or w.bind_info is None:
            raise PyverbsRDMAError(f"{what}: {f}.opcode IBV_WR_BIND_MW needs "
                                   f"set_bind_wr(mw, bind_info) ({f}.mw, {f}.bind_info)",
                                   errno.EINVAL)
        require(w.mw, MW, what, f"{f}.mw")
        info = require(w.bind_info, MWBindInfo, what, f"{f}.bind_info")
        require(info.mr, MR, what, f"{f}.bind_info.mr", optional=True)
        as_int(info.addr, what, f"{f}.bind_info.addr", U64, desc="not a 64-bit address")
        as_int(info.length, what, f"{f}.bind_info.length", U64, desc="not a 64-bit length")
        as_bits(info.mw_access_flags, what, f"{f}.bind_info.mw_access_flags",
                int(MR_ACCESS_BITS), noun="access flags")
        return as_int(w.bind_rkey, what, f"{f}.bind_rkey", U32, desc="not a 32-bit key")

    def _gather_inline(self, sges: list[tuple[int, int, int]], what: str) -> bytes:
        # Inline data is copied at post time; libibverbs ignores the lkey of inline SGEs, so
        # we accept any registered range (through its lkey, if it names an MR of this PD).
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
        """A type 1 bind as a BIND_MW work request (the API checked the arguments); the
        window's new rkey is ``ibv_inc_rkey`` of the old one."""
        wr = SendWR(wr_id=mw_bind.wr_id, opcode=W.IBV_WR_BIND_MW, send_flags=mw_bind.send_flags)
        new_key = (mw.rkey & ~0xFF) | ((mw.rkey + 1) & 0xFF)  # ibv_inc_rkey
        wr.set_bind_wr(mw, mw_bind.bind_info, new_key)
        self.post_send(wr)

    def attach_mcast(self, gid: bytes, lid: int) -> None:
        """ibv_attach_mcast (the API checked the QP type and the GID): rxe_attach_mcast."""
        with self.device.lock:
            try:
                self.device.mcast.attach(self.engine, gid)
            except OSError as e:
                raise PyverbsRDMAError(f"Failed to attach QP to multicast group: {e.strerror}",
                                       e.errno) from None

    def detach_mcast(self, gid: bytes, lid: int) -> None:
        """ibv_detach_mcast: rxe_detach_mcast (EINVAL if not attached)."""
        with self.device.lock:
            try:
                self.device.mcast.detach(self.engine, gid)
            except OSError as e:
                raise PyverbsRDMAError(f"Failed to detach QP from multicast group: "
                                       f"{e.strerror}", e.errno) from None

    def destroy(self) -> None:
        """Stop the engine and free the QP number (the caller holds the device lock); out
        of its multicast groups first, as uverbs detaches before it destroys."""
        self.device.mcast.detach_all(self.engine)
        self.engine.destroy()
        self.device.qps.pop(self.qp_num, None)
        self.device.qp_destroyed(self.engine)

    def describe(self, closed: bool) -> str:
        return f"<QP {self.qp_type.name.removeprefix('IBV_QPT_')} 0x{self.qp_num:x} {S(self.state).name}>"


def _roundup_pow2(n: int) -> int:
    return 0 if n <= 0 else 1 << (n - 1).bit_length()
