"""Conformance: the QP state machine. Each legal transition with the attribute mask the
IBTA / RDMA Aware Networks Programming User Manual table requires (conftest.REQUIRED), the
illegal ones refused with EINVAL (the kernel's ib_modify_qp_is_ok), a missing required or a
forbidden attribute refused with EINVAL and changing nothing, and ibv_query_qp reporting
what was set."""

from __future__ import annotations

import errno
import time

import pytest

from softrdma.verbs_api import QPAttr, QPCap
from softrdma.verbs_api import enums as E

from .conftest import ALL_REMOTE, QKEY, REQUIRED, M, qp_state, raises_errno

S = E.ibv_qp_state
RC, UC, UD = E.IBV_QPT_RC, E.IBV_QPT_UC, E.IBV_QPT_UD
TYPES = pytest.mark.parametrize("qpt", [RC, UC, UD], ids=["RC", "UC", "UD"])


def attr_for(res, qp, target: int) -> QPAttr:
    """A QPAttr with a valid value for every attribute the tests use."""
    a = QPAttr(qp_state=target)
    a.pkey_index, a.port_num = 0, 1
    a.qkey = QKEY
    a.qp_access_flags = ALL_REMOTE
    a.ah_attr = res.av()
    a.path_mtu = res.mtu
    a.dest_qp_num = qp.qp_num  # itself: never used for traffic here
    a.rq_psn, a.sq_psn = 0x10203, 0x40506
    a.max_dest_rd_atomic = a.max_rd_atomic = 1
    a.min_rnr_timer, a.timeout, a.retry_cnt, a.rnr_retry = 12, 14, 7, 7
    return a


def step(res, qp, target: str) -> None:
    qp.modify(attr_for(res, qp, getattr(S, f"IBV_QPS_{target}")),
              REQUIRED[(int(qp.qp_type), target)])


#: the longest an empty send queue may take to drain after RTS -> SQD: softrdma drains it
#: at once, rxe in its send task (a kworker), which a loaded machine runs late
DRAIN_WAIT = 10.0


def to_sqd(qp) -> None:
    """RTS -> SQD, then wait until the send queue is drained (``sq_draining`` clear), as a
    program waits for IBV_EVENT_SQ_DRAINED: while it drains, rxe refuses every transition
    out of SQD but the one to ERR (EINVAL), and CI's guest once ran the drain late enough
    for SQD -> RESET to meet it."""
    qp.modify(QPAttr(qp_state=S.IBV_QPS_SQD), M.IBV_QP_STATE)
    deadline = time.monotonic() + DRAIN_WAIT
    while qp.sq_draining:
        assert time.monotonic() < deadline, f"the empty SQ still drains after {DRAIN_WAIT} s"
        time.sleep(0.001)


def to(res, qp, target: str) -> None:
    """From RESET along RESET -> INIT -> RTR -> RTS (-> SQD, drained)."""
    for s in ("INIT", "RTR", "RTS"):
        step(res, qp, s)
        if s == target:
            return
    if target == "SQD":
        to_sqd(qp)
        return
    if target == "ERR":
        qp.modify(QPAttr(qp_state=S.IBV_QPS_ERR), M.IBV_QP_STATE)


@TYPES
def test_legal_path_with_required_masks_and_query(res, qpt):
    qp = res.qp(qpt)
    assert qp_state(qp) == S.IBV_QPS_RESET
    step(res, qp, "INIT")
    a, _ = qp.query(M.IBV_QP_STATE | M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT | M.IBV_QP_QKEY
                    | M.IBV_QP_ACCESS_FLAGS)
    assert a.qp_state == S.IBV_QPS_INIT and a.port_num == 1 and a.pkey_index == 0
    if qpt == UD:
        assert a.qkey == QKEY
    else:
        assert a.qp_access_flags == ALL_REMOTE
    # INIT -> INIT with an optional attribute only
    again = attr_for(res, qp, S.IBV_QPS_INIT)
    opt = M.IBV_QP_QKEY if qpt == UD else M.IBV_QP_ACCESS_FLAGS
    again.qkey, again.qp_access_flags = 0x2222, E.IBV_ACCESS_LOCAL_WRITE
    qp.modify(again, M.IBV_QP_STATE | opt)
    a, _ = qp.query(M.IBV_QP_QKEY | M.IBV_QP_ACCESS_FLAGS)
    if qpt == UD:
        assert a.qkey == 0x2222
    else:
        assert a.qp_access_flags == E.IBV_ACCESS_LOCAL_WRITE
    step(res, qp, "RTR")
    a, _ = qp.query(M.IBV_QP_STATE | M.IBV_QP_PATH_MTU | M.IBV_QP_DEST_QPN | M.IBV_QP_RQ_PSN
                    | M.IBV_QP_AV | M.IBV_QP_MAX_DEST_RD_ATOMIC | M.IBV_QP_MIN_RNR_TIMER)
    assert a.qp_state == S.IBV_QPS_RTR
    if qpt != UD:
        assert (a.path_mtu, a.dest_qp_num, a.rq_psn) == (res.mtu, qp.qp_num, 0x10203)
        assert a.ah_attr.is_global and a.ah_attr.gr.dgid == res.gid
        assert a.ah_attr.gr.sgid_index == res.gid_index
    if qpt == RC:
        assert (a.max_dest_rd_atomic, a.min_rnr_timer) == (1, 12)
    step(res, qp, "RTS")
    a, _ = qp.query(M.IBV_QP_STATE | M.IBV_QP_SQ_PSN | M.IBV_QP_TIMEOUT | M.IBV_QP_RETRY_CNT
                    | M.IBV_QP_RNR_RETRY | M.IBV_QP_MAX_QP_RD_ATOMIC)
    assert a.qp_state == S.IBV_QPS_RTS and a.sq_psn == 0x40506
    if qpt == RC:
        assert (a.timeout, a.retry_cnt, a.rnr_retry, a.max_rd_atomic) == (14, 7, 7, 1)
    # RTS -> RTS with an optional attribute
    rts = attr_for(res, qp, S.IBV_QPS_RTS)
    if qpt == RC:
        rts.min_rnr_timer = 5
        qp.modify(rts, M.IBV_QP_STATE | M.IBV_QP_MIN_RNR_TIMER)
        assert qp.query(M.IBV_QP_MIN_RNR_TIMER)[0].min_rnr_timer == 5
    elif qpt == UD:
        rts.qkey = 0x3333
        qp.modify(rts, M.IBV_QP_QKEY)
        assert qp.query(M.IBV_QP_QKEY)[0].qkey == 0x3333
    else:
        rts.qp_access_flags = E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_LOCAL_WRITE
        qp.modify(rts, M.IBV_QP_ACCESS_FLAGS)
        assert qp.query(M.IBV_QP_ACCESS_FLAGS)[0].qp_access_flags == rts.qp_access_flags
    assert qp_state(qp) == S.IBV_QPS_RTS
    # RTS -> SQD (drained) -> RTS
    to_sqd(qp)
    assert qp_state(qp) == S.IBV_QPS_SQD
    qp.modify(QPAttr(qp_state=S.IBV_QPS_RTS), M.IBV_QP_STATE)
    assert qp_state(qp) == S.IBV_QPS_RTS
    # -> ERR -> RESET -> INIT: the QP is reusable
    qp.modify(QPAttr(qp_state=S.IBV_QPS_ERR), M.IBV_QP_STATE)
    assert qp_state(qp) == S.IBV_QPS_ERR
    qp.modify(QPAttr(qp_state=S.IBV_QPS_RESET), M.IBV_QP_STATE)
    assert qp_state(qp) == S.IBV_QPS_RESET
    step(res, qp, "INIT")
    assert qp_state(qp) == S.IBV_QPS_INIT


@TYPES
@pytest.mark.parametrize("frm", ["INIT", "RTR", "RTS", "SQD", "ERR"])
def test_any_state_to_reset_and_err(res, qpt, frm):
    for target in (S.IBV_QPS_ERR, S.IBV_QPS_RESET):
        qp = res.qp(qpt)
        to(res, qp, frm)
        qp.modify(QPAttr(qp_state=target), M.IBV_QP_STATE)
        assert qp_state(qp) == target


ILLEGAL = [("RESET", "RTR"), ("RESET", "RTS"), ("RESET", "SQD"), ("RESET", "ERR"),
           ("INIT", "RTS"), ("INIT", "SQD"), ("RTR", "INIT"), ("RTR", "SQD"),
           ("RTS", "INIT"), ("RTS", "RTR"), ("ERR", "INIT"), ("ERR", "RTS")]


@TYPES
@pytest.mark.parametrize("frm,target", ILLEGAL, ids=[f"{a}->{b}" for a, b in ILLEGAL])
def test_illegal_transitions_are_einval_and_change_nothing(res, qpt, frm, target):
    qp = res.qp(qpt)
    if frm != "RESET":
        to(res, qp, frm)
    before = qp_state(qp)
    t = getattr(S, f"IBV_QPS_{target}")
    # with every attribute the target would need, so only the transition itself is wrong
    need = REQUIRED.get((int(qpt), target), M.IBV_QP_STATE)
    raises_errno(errno.EINVAL, qp.modify, attr_for(res, qp, t), need | M.IBV_QP_STATE)
    assert qp_state(qp) == before


@pytest.mark.parametrize("qpt,target", [(RC, "INIT"), (RC, "RTR"), (RC, "RTS"), (UC, "INIT"),
                                        (UC, "RTR"), (UC, "RTS"), (UD, "INIT"), (UD, "RTS")])
def test_each_required_attribute_is_required(res, qpt, target):
    req = int(REQUIRED[(qpt, target)])
    bits = [1 << i for i in range(26) if req & (1 << i) and (1 << i) != M.IBV_QP_STATE]
    assert bits
    for bit in bits:
        qp = res.qp(qpt)
        if target != "INIT":
            to(res, qp, {"RTR": "INIT", "RTS": "RTR"}[target])
        before = qp_state(qp)
        raises_errno(errno.EINVAL, qp.modify,
                     attr_for(res, qp, getattr(S, f"IBV_QPS_{target}")), req & ~bit)
        assert qp_state(qp) == before, M(bit).name


@pytest.mark.parametrize("qpt,target,extra", [
    (UD, "INIT", M.IBV_QP_ACCESS_FLAGS),   # UD has no access flags
    (RC, "INIT", M.IBV_QP_QKEY),           # RC has no Q_Key
    (RC, "RTS", M.IBV_QP_PATH_MTU),        # the path is set in RTR only
    (UC, "RTS", M.IBV_QP_MAX_QP_RD_ATOMIC),  # UC has no RDMA READ / atomics
    (UD, "RTR", M.IBV_QP_AV),              # UD addresses each WR with an AH
], ids=["UD-INIT-ACCESS", "RC-INIT-QKEY", "RC-RTS-PATH_MTU", "UC-RTS-RD_ATOMIC", "UD-RTR-AV"])
def test_forbidden_attributes_are_einval(res, qpt, target, extra):
    qp = res.qp(qpt)
    if target != "INIT":
        to(res, qp, {"RTR": "INIT", "RTS": "RTR"}[target])
    before = qp_state(qp)
    raises_errno(errno.EINVAL, qp.modify, attr_for(res, qp, getattr(S, f"IBV_QPS_{target}")),
                 REQUIRED[(qpt, target)] | extra)
    assert qp_state(qp) == before


def test_out_of_range_values_are_einval(res, differs):
    qp = res.qp(RC)
    to(res, qp, "INIT")
    a = attr_for(res, qp, S.IBV_QPS_RTR)
    a.path_mtu = 6  # no such IBV_MTU
    raises_errno(errno.EINVAL, qp.modify, a, REQUIRED[(RC, "RTR")])
    a = attr_for(res, qp, S.IBV_QPS_RTR)
    a.ah_attr.gr.sgid_index = next(i for i in range(256) if not res.ctx.query_gid(1, i))
    raises_errno(differs("empty_sgid_index"), qp.modify, a, REQUIRED[(RC, "RTR")])
    assert qp_state(qp) == S.IBV_QPS_INIT
    step(res, qp, "RTR")
    a = attr_for(res, qp, S.IBV_QPS_RTS)
    a.timeout = 32  # a 5-bit field
    raises_errno(errno.EINVAL, qp.modify, a, REQUIRED[(RC, "RTS")])
    assert qp_state(qp) == S.IBV_QPS_RTR


def test_rd_atomic_is_rounded_up_to_a_power_of_two(res):
    qp = res.qp(RC)
    to(res, qp, "INIT")
    a = attr_for(res, qp, S.IBV_QPS_RTR)
    a.max_dest_rd_atomic = 3
    qp.modify(a, REQUIRED[(RC, "RTR")])
    a = attr_for(res, qp, S.IBV_QPS_RTS)
    a.max_rd_atomic = 5
    qp.modify(a, REQUIRED[(RC, "RTS")])
    got = qp.query(M.IBV_QP_MAX_QP_RD_ATOMIC | M.IBV_QP_MAX_DEST_RD_ATOMIC)[0]
    assert (got.max_dest_rd_atomic, got.max_rd_atomic) == (4, 8)  # rxe: roundup_pow_of_two


def test_retry_cnt_above_7(res, differs):
    qp = res.qp(RC)
    to(res, qp, "RTR")
    a = attr_for(res, qp, S.IBV_QPS_RTS)
    a.retry_cnt = 8
    if differs("retry_cnt_8") == "EINVAL":
        raises_errno(errno.EINVAL, qp.modify, a, REQUIRED[(RC, "RTS")])
        assert qp_state(qp) == S.IBV_QPS_RTR
    else:
        qp.modify(a, REQUIRED[(RC, "RTS")])
        assert qp_state(qp) == S.IBV_QPS_RTS


def test_cur_qp_state_that_is_not_the_current_state(res, differs):
    qp = res.qp(RC)
    to(res, qp, "RTS")
    a = QPAttr(qp_state=S.IBV_QPS_RTS, cur_qp_state=S.IBV_QPS_SQD)
    if differs("cur_qp_state_wrong") == "EINVAL":
        raises_errno(errno.EINVAL, qp.modify, a, M.IBV_QP_STATE | M.IBV_QP_CUR_STATE)
    else:
        qp.modify(a, M.IBV_QP_STATE | M.IBV_QP_CUR_STATE)
    assert qp_state(qp) == S.IBV_QPS_RTS


@TYPES
def test_posting_before_rts(res, qpt):
    """post_recv is refused in RESET and allowed from INIT; post_send needs RTS (or SQD)."""
    from softrdma.verbs_api import RecvWR, SendWR
    qp = res.qp(qpt, QPCap(max_send_wr=2, max_recv_wr=2))
    raises_errno(errno.EINVAL, qp.post_recv, RecvWR(wr_id=1))
    for s in ("INIT", "RTR"):
        step(res, qp, s)
        raises_errno(errno.EINVAL, qp.post_send, SendWR(wr_id=2))
    qp.post_recv(RecvWR(wr_id=3))
