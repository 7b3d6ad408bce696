"""pyverbs.qp: QP, QPEx, QPCap, QPInitAttr, QPInitAttrEx, QPAttr.

``QPEx`` is the extended QP (``ibv_qp_ex``): ``wr_start()``, then per WR ``wr_id``,
``wr_flags``, an opcode call (``wr_send``, ``wr_send_imm``, ``wr_rdma_write``,
``wr_rdma_write_imm``, ``wr_rdma_read``, ``wr_atomic_cmp_swp``, ``wr_atomic_fetch_add``,
``wr_atomic_write``, ``wr_flush``, ``wr_bind_mw``, ``wr_local_inv``, ``wr_send_inv``), its address (``wr_set_ud_addr``) and
data (``wr_set_sge``, ``wr_set_sge_list``, ``wr_set_inline_data``), then ``wr_complete()``
posts them all (or ``wr_abort()`` drops them). The send ops a QP type accepts are librxe's.
"""

from __future__ import annotations

import errno
import socket
import sys as _sys
from typing import Any

from ..errors import PyverbsRDMAError, PyverbsUserError
from ..verbs_api.attr import QPAttr as _QPAttr, QPCap as _QPCap, QPInitAttr as _QPInitAttr
from ..verbs_api.enums import ibv_qp_attr_mask as M, ibv_qp_state as S, ibv_qp_type as T
from ..verbs_api.enums import ibv_wr_opcode as O
from ..verbs_api.qp import QP as _QP
from . import unsupported
from ._close import CascadeClose
from .wr import SGE, SendWR

__all__ = ["QP", "QPEx", "QPCap", "QPInitAttr", "QPInitAttrEx", "QPAttr"]

# ibv_qp_init_attr_mask, ibv_qp_create_send_ops_flags
IBV_QP_INIT_ATTR_PD, IBV_QP_INIT_ATTR_CREATE_FLAGS, IBV_QP_INIT_ATTR_SEND_OPS_FLAGS = 1, 4, 64
_RXE_QP_COMP_MASK_SUP = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_CREATE_FLAGS | \
    IBV_QP_INIT_ATTR_SEND_OPS_FLAGS
W_RDMA_WRITE, W_RDMA_WRITE_IMM, W_SEND, W_SEND_IMM, W_RDMA_READ = 1, 2, 4, 8, 16
W_CMP_SWP, W_FETCH_ADD, W_LOCAL_INV, W_BIND_MW, W_SEND_INV, W_TSO = 32, 64, 128, 256, 512, 1024
W_FLUSH, W_ATOMIC_WRITE = 2048, 4096
_RXE_SEND_OPS = {
    T.IBV_QPT_RC: W_RDMA_WRITE | W_RDMA_WRITE_IMM | W_SEND | W_SEND_IMM | W_RDMA_READ |
    W_CMP_SWP | W_FETCH_ADD | W_LOCAL_INV | W_BIND_MW | W_SEND_INV | W_FLUSH | W_ATOMIC_WRITE,
    T.IBV_QPT_UC: W_RDMA_WRITE | W_RDMA_WRITE_IMM | W_SEND | W_SEND_IMM | W_BIND_MW |
    W_SEND_INV,
    T.IBV_QPT_UD: W_SEND | W_SEND_IMM,
}


class QPCap(_QPCap):
    def __init__(self, max_send_wr: int = 1, max_recv_wr: int = 10, max_send_sge: int = 1,
                 max_recv_sge: int = 1, max_inline_data: int = 0) -> None:
        super().__init__(max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data)


def _cap_field(name: str) -> property:
    def get(self: Any) -> int:
        return getattr(self.cap, name)

    def put(self: Any, v: int) -> None:
        setattr(self.cap, name, v)
    return property(get, put)


class _CapFields:
    """pyverbs' init attributes expose the cap fields directly (``qia.max_send_wr = n``)."""

    max_send_wr = _cap_field("max_send_wr")
    max_recv_wr = _cap_field("max_recv_wr")
    max_send_sge = _cap_field("max_send_sge")
    max_recv_sge = _cap_field("max_recv_sge")
    max_inline_data = _cap_field("max_inline_data")


class QPInitAttr(_CapFields, _QPInitAttr):
    def __init__(self, qp_type: int = T.IBV_QPT_UD, qp_context: Any = None, scq: Any = None,
                 rcq: Any = None, srq: Any = None, cap: Any = None, sq_sig_all: int = 1) -> None:
        super().__init__(qp_type=qp_type, qp_context=qp_context, scq=scq, rcq=rcq, srq=srq,
                         cap=cap if cap is not None else QPCap(), sq_sig_all=sq_sig_all)

    @property
    def send_cq(self) -> Any:
        return self.scq

    @property
    def recv_cq(self) -> Any:
        return self.rcq


class QPInitAttrEx(_CapFields):
    def __init__(self, qp_type: int = T.IBV_QPT_UD, qp_context: Any = None, scq: Any = None,
                 rcq: Any = None, srq: Any = None, cap: Any = None, sq_sig_all: int = 0,
                 comp_mask: int = 0, pd: Any = None, xrcd: Any = None, create_flags: int = 0,
                 max_tso_header: int = 0, source_qpn: int = 0, hash_conf: Any = None,
                 ind_table: Any = None, send_ops_flags: int = 0) -> None:
        from .cq import CQ, CQEX
        for name, cq in (("scq", scq), ("rcq", rcq)):
            if cq is not None and not isinstance(cq, (CQ, CQEX)):
                raise PyverbsUserError(f"Expected CQ/CQEX, got {type(cq)}")
        self.qp_type, self.qp_context, self.scq, self.rcq, self.srq = \
            qp_type, qp_context, scq, rcq, srq
        self.cap = cap if cap is not None else QPCap()
        self.sq_sig_all, self.comp_mask, self.pd, self.xrcd = sq_sig_all, comp_mask, pd, xrcd
        self.create_flags, self.max_tso_header, self.source_qpn = \
            create_flags, max_tso_header, source_qpn
        self.hash_conf, self.ind_table, self.send_ops_flags = hash_conf, ind_table, send_ops_flags

    @property
    def send_cq(self) -> Any:
        return self.scq

    @send_cq.setter
    def send_cq(self, cq: Any) -> None:
        self.scq = cq

    @property
    def recv_cq(self) -> Any:
        return self.rcq

    @recv_cq.setter
    def recv_cq(self, cq: Any) -> None:
        self.rcq = cq


class QPAttr(_QPAttr):
    def __init__(self, qp_state: int = S.IBV_QPS_INIT, cur_qp_state: int = S.IBV_QPS_RESET,
                 port_num: int = 1, path_mtu: int = 3) -> None:
        super().__init__(qp_state=qp_state, cur_qp_state=cur_qp_state, port_num=port_num,
                         path_mtu=path_mtu)

    @property
    def dest_qp_num_(self) -> int:
        return self.dest_qp_num


_MASKS = {
    T.IBV_QPT_RC: {"INIT": M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT | M.IBV_QP_ACCESS_FLAGS,
                   "RTR": M.IBV_QP_AV | M.IBV_QP_PATH_MTU | M.IBV_QP_DEST_QPN |
                   M.IBV_QP_RQ_PSN | M.IBV_QP_MAX_DEST_RD_ATOMIC | M.IBV_QP_MIN_RNR_TIMER,
                   "RTS": M.IBV_QP_TIMEOUT | M.IBV_QP_RETRY_CNT | M.IBV_QP_RNR_RETRY |
                   M.IBV_QP_SQ_PSN | M.IBV_QP_MAX_QP_RD_ATOMIC},
    T.IBV_QPT_UC: {"INIT": M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT | M.IBV_QP_ACCESS_FLAGS,
                   "RTR": M.IBV_QP_AV | M.IBV_QP_PATH_MTU | M.IBV_QP_DEST_QPN |
                   M.IBV_QP_RQ_PSN,
                   "RTS": M.IBV_QP_SQ_PSN},
    T.IBV_QPT_UD: {"INIT": M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT | M.IBV_QP_QKEY, "RTR": 0,
                   "RTS": M.IBV_QP_SQ_PSN},
}


_IMM_OPS = (O.IBV_WR_SEND_WITH_IMM, O.IBV_WR_RDMA_WRITE_WITH_IMM)


class QP(CascadeClose, _QP):
    def __init__(self, creator: Any, init_attr: Any, qp_attr: Any = None) -> None:
        from .pd import PD
        if isinstance(init_attr, QPInitAttrEx):
            a = init_attr
            if a.comp_mask & ~_RXE_QP_COMP_MASK_SUP or \
                    (a.comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS and a.create_flags) or \
                    a.xrcd is not None or a.ind_table is not None or \
                    (a.comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS and
                     a.send_ops_flags & ~_RXE_SEND_OPS.get(a.qp_type, 0)) or \
                    a.qp_type not in _RXE_SEND_OPS:
                raise PyverbsRDMAError("Failed to create QP", errno.EOPNOTSUPP)
            pd = creator if isinstance(creator, PD) else a.pd
            if pd is None or not (isinstance(creator, PD) or a.comp_mask & IBV_QP_INIT_ATTR_PD):
                raise PyverbsRDMAError("Failed to create QP", errno.EINVAL)
            base = _QPInitAttr(qp_type=a.qp_type, qp_context=a.qp_context, scq=a.scq,
                               rcq=a.rcq, srq=a.srq, cap=a.cap, sq_sig_all=a.sq_sig_all)
        else:
            pd, base = creator, init_attr
        try:
            super().__init__(pd, base)
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError("Failed to create QP", e.error_code) from None
        init_attr.cap = base.cap
        self.init_attr = init_attr
        if qp_attr is not None:
            if self.qp_type in (T.IBV_QPT_UD, T.IBV_QPT_RAW_PACKET):
                self.to_rts(qp_attr)
            else:
                self.to_init(qp_attr)

    def _get_comp_mask(self, dst: str) -> int:
        return _MASKS[self.qp_type][dst] | M.IBV_QP_STATE

    def _mod(self, attr: Any, mask: int, msg: str) -> None:
        try:  # the next class's modify: the soft QP's, or the ibverbs backend's
            super(QP, self).modify(attr, mask)
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError(msg, e.error_code) from None

    def to_init(self, qp_attr: Any) -> None:
        qp_attr.qp_state = S.IBV_QPS_INIT
        self._mod(qp_attr, self._get_comp_mask("INIT"), "Failed to modify QP state to init")

    def to_rtr(self, qp_attr: Any) -> None:
        if self.qp_state != S.IBV_QPS_INIT:
            self.to_init(qp_attr)
        qp_attr.qp_state = S.IBV_QPS_RTR
        self._mod(qp_attr, self._get_comp_mask("RTR"), "Failed to modify QP state to RTR")

    def to_rts(self, qp_attr: Any) -> None:
        if self.qp_state != S.IBV_QPS_RTR:
            self.to_rtr(qp_attr)
        qp_attr.qp_state = S.IBV_QPS_RTS
        self._mod(qp_attr, self._get_comp_mask("RTS"), "Failed to modify QP state to RTS")

    def modify(self, qp_attr: Any, comp_mask: int) -> None:
        self._mod(qp_attr, comp_mask, "Failed to modify QP")

    def query(self, attr_mask: int) -> tuple:
        try:
            a, ia = super().query(attr_mask)
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError("Failed to query QP", e.error_code) from None
        return a, ia

    def post_recv(self, wr: Any, bad_wr: Any = None) -> None:
        try:
            super().post_recv(wr, bad_wr)
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError("Failed to post recv", e.error_code) from None

    def post_send(self, wr: Any, bad_wr: Any = None) -> None:
        # pyverbs' imm_data is the raw __be32 of ibv_send_wr (rdma-core's tests put
        # socket.htonl(x) in it); softrdma's verbs take the host integer whose big-endian
        # bytes go on the wire. Each WITH_IMM WR of the chain carries ntohl(raw) for the
        # post only, so the bytes on the wire are real pyverbs' on either backend.
        swapped = []
        seen: set[int] = set()
        w = wr
        while w is not None and id(w) not in seen and not isinstance(w, list):
            seen.add(id(w))
            raw = getattr(w, "imm_data", None)
            if getattr(w, "opcode", None) in _IMM_OPS and type(raw) is int and 0 <= raw < 1 << 32:
                swapped.append((w, raw))
                w.imm_data = socket.ntohl(raw)
            w = getattr(w, "next_wr", None)
        try:
            super().post_send(wr, bad_wr)
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError("Failed to post send", e.error_code) from None
        finally:
            for w, raw in swapped:
                w.imm_data = raw

    def bind_mw(self, mw: Any, mw_bind: Any) -> None:
        try:
            super().bind_mw(mw, mw_bind)
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError("Failed to Bind MW", e.error_code) from None

    def close(self) -> None:
        try:
            CascadeClose.close(self)
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError("Failed to destroy QP", e.error_code) from None

    def query_data_in_order(self, op: int, flags: int = 0) -> int:
        """ibv_query_qp_data_in_order: 0 (not guaranteed), as libibverbs answers for rxe,
        whose provider does not implement the query."""
        return 0

    def set_ece(self, ece: Any) -> None:
        if getattr(ece, "vendor_id", 0):
            raise PyverbsRDMAError("Failed to set ECE", errno.EOPNOTSUPP)

    def query_ece(self) -> Any:
        raise PyverbsRDMAError("Failed to query ECE", errno.EOPNOTSUPP)


class QPEx(QP):
    """ibv_qp_ex: the wr_* posting API."""

    def __init__(self, creator: Any, init_attr: Any, qp_attr: Any = None) -> None:
        super().__init__(creator, init_attr, qp_attr)
        self.ind_table = None
        self.comp_mask = 0
        self.wr_id = 0
        self.wr_flags = 0
        self._ops = getattr(init_attr, "send_ops_flags", 0) \
            if getattr(init_attr, "comp_mask", 0) & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS else 0
        self._batch: list[SendWR] | None = None
        self._cur: SendWR | None = None

    def wr_start(self) -> None:
        self._batch = []
        self._cur = None

    def _new(self, opcode: int, op_flag: int) -> SendWR:
        if self._batch is None:
            self._batch = []
        wr = SendWR.__new__(SendWR)
        _init_sendwr(wr, self.wr_id, opcode, self.wr_flags)
        if not self._ops & op_flag:
            wr._bad_op = True  # type: ignore[attr-defined]
        self._batch.append(wr)
        self._cur = wr
        return wr

    def wr_send(self) -> None:
        self._new(O.IBV_WR_SEND, W_SEND)

    def wr_send_imm(self, data: int) -> None:
        # pyverbs converts here (htobe32(data) into the __be32): data is a host integer,
        # which is what softrdma's verbs take
        self._new(O.IBV_WR_SEND_WITH_IMM, W_SEND_IMM).imm_data = data

    def wr_send_inv(self, invalidate_rkey: int) -> None:
        self._new(O.IBV_WR_SEND_WITH_INV, W_SEND_INV).imm_data = invalidate_rkey

    def wr_rdma_write(self, rkey: int, remote_addr: int) -> None:
        self._new(O.IBV_WR_RDMA_WRITE, W_RDMA_WRITE).set_wr_rdma(rkey, remote_addr)

    def wr_rdma_write_imm(self, rkey: int, remote_addr: int, data: int) -> None:
        wr = self._new(O.IBV_WR_RDMA_WRITE_WITH_IMM, W_RDMA_WRITE_IMM)
        wr.set_wr_rdma(rkey, remote_addr)
        wr.imm_data = data  # a host integer, as wr_send_imm

    def wr_rdma_read(self, rkey: int, remote_addr: int) -> None:
        self._new(O.IBV_WR_RDMA_READ, W_RDMA_READ).set_wr_rdma(rkey, remote_addr)

    def wr_atomic_cmp_swp(self, rkey: int, remote_addr: int, compare: int, swap: int) -> None:
        self._new(O.IBV_WR_ATOMIC_CMP_AND_SWP, W_CMP_SWP).set_wr_atomic(rkey, remote_addr,
                                                                        compare, swap)

    def wr_atomic_fetch_add(self, rkey: int, remote_addr: int, add: int) -> None:
        self._new(O.IBV_WR_ATOMIC_FETCH_AND_ADD, W_FETCH_ADD).set_wr_atomic(rkey, remote_addr,
                                                                            add)

    def wr_atomic_write(self, rkey: int, remote_addr: int, atomic_wr: bytes) -> None:
        # ibv_wr_atomic_write: pyverbs hands the bytes' buffer to C, which copies 8 of them
        self._new(O.IBV_WR_ATOMIC_WRITE, W_ATOMIC_WRITE).set_wr_atomic_write(
            rkey, remote_addr, atomic_wr)

    def wr_flush(self, rkey: int, remote_addr: int, length: int, ptype: int,
                 level: int) -> None:
        self._new(O.IBV_WR_FLUSH, W_FLUSH).set_wr_flush(rkey, remote_addr, length, ptype,
                                                       level)

    def wr_local_inv(self, invalidate_rkey: int) -> None:
        self._new(O.IBV_WR_LOCAL_INV, W_LOCAL_INV).imm_data = invalidate_rkey

    def wr_bind_mw(self, mw: Any, rkey: int, bind_info: Any) -> None:
        wr = self._new(O.IBV_WR_BIND_MW, W_BIND_MW)
        wr.mw, wr.bind_info, wr.bind_rkey = mw, bind_info, rkey

    def wr_send_tso(self, hdr: Any, hdr_sz: int, mss: int) -> None:
        self._new(O.IBV_WR_TSO, W_TSO)

    def wr_set_ud_addr(self, ah: Any, remote_qpn: int, remote_rkey: int) -> None:
        if self._cur is not None:
            self._cur.set_wr_ud(ah, remote_qpn, remote_rkey)

    def wr_set_xrc_srqn(self, remote_srqn: int) -> None:
        if self._cur is not None:
            self._cur._bad_op = True  # type: ignore[attr-defined]

    def wr_set_sge(self, sge: Any) -> None:
        if self._cur is not None:
            self._cur.sg_list = [SGE(sge.addr, sge.length, sge.lkey)]
            self._cur.num_sge = 1

    def wr_set_sge_list(self, num_sge: int, sg_list: Any) -> None:
        if self._cur is not None:
            self._cur.sg_list = [SGE(s.addr, s.length, s.lkey) for s in list(sg_list)[:num_sge]]
            self._cur.num_sge = len(self._cur.sg_list)

    def wr_set_inline_data(self, addr: int, length: int) -> None:
        if self._cur is not None:
            self._cur._inline = (addr, length)  # type: ignore[attr-defined]
            self._cur._bad_op = True  # type: ignore[attr-defined]

    def wr_set_inline_data_list(self, num_buf: int, buf_list: Any) -> None:
        self.wr_set_inline_data(0, 0)

    def wr_complete(self) -> None:
        batch, self._batch, self._cur = self._batch or [], None, None
        for wr in batch:
            if getattr(wr, "_bad_op", False):
                # librxe checks the opcode against the QP's send_ops_flags and the state
                # when the WRs are built; the batch is refused as a whole
                raise PyverbsRDMAError("ibv_wr_complete failed.", errno.EINVAL)
        if not batch:
            return
        try:  # past QP.post_send (its imm conversion): these WRs hold host integers
            super(QP, self).post_send(batch)
        except PyverbsRDMAError as e:
            raise PyverbsRDMAError("ibv_wr_complete failed.", e.error_code) from None

    def wr_abort(self) -> None:
        self._batch, self._cur = None, None


def _init_sendwr(wr: SendWR, wr_id: int, opcode: int, flags: int) -> None:
    from ..verbs_api.wr import SendWR as _SendWR
    _SendWR.__init__(wr, wr_id=wr_id, opcode=opcode, sg=(), send_flags=flags)


unsupported.fill_missing(_sys.modules[__name__], "qp")  # ECE, DataBuffer
