"""Conformance: error paths. Posting errors are the errno librxe / the kernel return
(ENOMEM for a full queue, EINVAL for too many SGEs or inline data over the QP's limit);
data-path errors are completion statuses (rxe_req.c/rxe_comp.c/rxe_resp.c, facts
A.10-A.12): a bad lkey or an SGE outside its MR is IBV_WC_LOC_PROT_ERR, a bad rkey, an
access the remote MR does not grant or a range outside it is IBV_WC_REM_ACCESS_ERR, an
error moves the QP to ERR, and everything then outstanding or posted later completes
with IBV_WC_WR_FLUSH_ERR. RNR: a SEND with no receive posted waits (RNR NAK, retried) until
one is posted, or with rnr_retry 0 fails with IBV_WC_RNR_RETRY_EXC_ERR."""

from __future__ import annotations

import errno

import pytest

from softrdma.verbs_api import MW, SGE, MWBind, MWBindInfo, QPAttr, QPCap, RecvWR, SendWR
from softrdma.verbs_api import enums as E

from .conftest import (
    LW, QKEY, RR, M, poll, poll_none, qp_state, raises_errno, recv_wr, send_wr,
)

OK = E.IBV_WC_SUCCESS
FLUSH = E.IBV_WC_WR_FLUSH_ERR


def own_status(differs, status):
    """What the WR that failed at the requester completes with: its own ``status`` (IBTA),
    or WR_FLUSH_ERR on rxe 6.12 (DIFFERENCES["requester_error_status"])."""
    want = differs("requester_error_status")
    return status if want == "own status" else getattr(E, want)
RC, UC, UD = E.IBV_QPT_RC, E.IBV_QPT_UC, E.IBV_QPT_UD
ALL3 = pytest.mark.parametrize("qpt", [RC, UC, UD], ids=["RC", "UC", "UD"])


def by_qp(wcs, qp):
    return [w for w in wcs if w.qp_num == qp.qp_num]


# -- posting errors -------------------------------------------------------------------------

def test_full_send_queue_is_enomem(res):
    """An RC QP whose peer does not exist: nothing is ever ACKed, so every posted WR keeps
    its slot; exactly the reported max_send_wr fit, one more is ENOMEM."""
    qp = res.qp(RC, QPCap(max_send_wr=3, max_recv_wr=1))
    dead = res.qp(RC)  # its QPN is the destination, but it stays in RESET: drops all
    res.connect(qp, dead.qp_num, rq_psn=0, sq_psn=0)
    n = qp.query(M.IBV_QP_CAP)[0].cap.max_send_wr
    mr = res.mr()
    for i in range(n):
        qp.post_send(send_wr(mr, 0, 8, wr_id=i))
    raises_errno(errno.ENOMEM, qp.post_send, send_wr(mr, 0, 8, wr_id=99))
    qp.modify(QPAttr(qp_state=E.IBV_QPS_ERR), M.IBV_QP_STATE)
    wcs = poll(res.cq, n)
    assert [(w.wr_id, w.status) for w in wcs] == [(i, FLUSH) for i in range(n)]


@ALL3
def test_full_receive_queue_is_enomem(res, qpt):
    qp = res.qp(qpt, QPCap(max_send_wr=1, max_recv_wr=5))
    res.to_init(qp)
    n = qp.query(M.IBV_QP_CAP)[0].cap.max_recv_wr
    for i in range(n):
        qp.post_recv(RecvWR(wr_id=i))
    raises_errno(errno.ENOMEM, qp.post_recv, RecvWR(wr_id=99))


@ALL3
def test_too_many_sges_is_einval(res, qpt):
    a, b = res.pair(qpt, QPCap(max_send_wr=4, max_recv_wr=4, max_send_sge=1, max_recv_sge=1))
    cap = a.query(M.IBV_QP_CAP)[0].cap
    mr = res.mr()
    sge = SGE(mr.buf, 4, mr.lkey)
    wr = SendWR(wr_id=1, sg=[sge] * (cap.max_send_sge + 1))
    if qpt == UD:
        wr.set_wr_ud(res.ah(), b.qp_num, QKEY)
    raises_errno(errno.EINVAL, a.post_send, wr)
    raises_errno(errno.EINVAL, b.post_recv, RecvWR(wr_id=2, sg=[sge] * (cap.max_recv_sge + 1)))
    poll_none(res.cq, 0.05)  # nothing was posted


def test_inline_over_the_limit_is_einval(res):
    a, _ = res.pair(RC, QPCap(max_send_wr=2, max_recv_wr=2, max_inline_data=32))
    limit = a.query(M.IBV_QP_CAP)[0].cap.max_inline_data
    mr = res.mr()
    raises_errno(errno.EINVAL, a.post_send,
                 send_wr(mr, 0, limit + 1, flags=E.IBV_SEND_SIGNALED | E.IBV_SEND_INLINE))


@pytest.mark.parametrize("qpt,opcode", [(UC, E.IBV_WR_RDMA_READ), (UD, E.IBV_WR_RDMA_WRITE)],
                         ids=["UC-READ", "UD-WRITE"])
def test_opcode_the_qp_type_cannot_carry(res, differs, qpt, opcode):
    a, b = res.pair(qpt)
    mr = res.mr()
    wr = send_wr(mr, 0, 8, wr_id=1, opcode=opcode)
    wr.set_wr_rdma(mr.rkey, mr.buf + 1024)
    if qpt == UD:
        wr.set_wr_ud(res.ah(), b.qp_num, QKEY)
    want = differs("opcode_not_for_qp_type")
    if want == "EINVAL":
        raises_errno(errno.EINVAL, a.post_send, wr)
        poll_none(res.cq, 0.05)
        assert qp_state(a) == E.IBV_QPS_RTS
    else:
        a.post_send(wr)
        (wc,) = poll(res.cq, 1)
        assert (wc.wr_id, wc.status) == (1, own_status(differs, getattr(E, want)))
        assert qp_state(a) == E.IBV_QPS_ERR
    assert mr.read(8, 1024) == bytes(8)


# -- local errors ---------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["bad-lkey", "past-the-end", "before-the-start"])
@ALL3
def test_local_protection_error(res, qpt, case, differs):
    a, b = res.pair(qpt)
    mr = res.mr(4096)
    sge = {"bad-lkey": SGE(mr.buf, 8, mr.lkey ^ 0x5A5A00),
           "past-the-end": SGE(mr.buf + 4090, 8, mr.lkey),
           "before-the-start": SGE(mr.buf - 4, 8, mr.lkey)}[case]
    b.post_recv(recv_wr(mr, 0, 64, wr_id=9))
    wr = SendWR(wr_id=1, sg=[sge])
    if qpt == UD:
        wr.set_wr_ud(res.ah(), b.qp_num, QKEY)
    a.post_send(wr)
    (wc,) = poll(res.cq, 1)
    want = getattr(E, differs("bad_lkey_status")) if case == "bad-lkey" else \
        E.IBV_WC_LOC_PROT_ERR  # an SGE outside a valid MR: LOC_PROT_ERR on both
    assert (wc.wr_id, wc.status, wc.qp_num) == (1, own_status(differs, want), a.qp_num)
    assert qp_state(a) == E.IBV_QPS_ERR  # rxe has no SQE: any QP type goes to ERR
    assert qp_state(b) == E.IBV_QPS_RTS
    # later WRs are flushed
    a.post_send(SendWR(wr_id=2, sg=[SGE(mr.buf, 8, mr.lkey)], send_flags=0) if qpt != UD
                else _ud(res, b, mr, 2))
    (wc,) = poll(res.cq, 1)
    assert (wc.wr_id, wc.status) == (2, FLUSH)  # flush errors always complete


def _ud(res, b, mr, wr_id):
    wr = SendWR(wr_id=wr_id, sg=[SGE(mr.buf, 8, mr.lkey)], send_flags=0)
    wr.set_wr_ud(res.ah(), b.qp_num, QKEY)
    return wr


def test_read_result_into_memory_without_local_write(res):
    a, b = res.pair(RC)
    ro, remote = res.mr(4096, RR), res.mr(4096)
    wr = send_wr(ro, 0, 8, wr_id=1, opcode=E.IBV_WR_RDMA_READ)
    wr.set_wr_rdma(remote.rkey, remote.buf)
    a.post_send(wr)
    (wc,) = poll(res.cq, 1)
    assert (wc.wr_id, wc.status) == (1, E.IBV_WC_LOC_PROT_ERR)
    assert qp_state(a) == E.IBV_QPS_ERR


def test_receive_buffer_with_a_bad_lkey(res):
    """The responder cannot place the data: rxe's copy_data fails (-EINVAL), which is
    RESPST_ERR_MALFORMED_WQE: the receive completes with IBV_WC_LOC_QP_OP_ERR, the NAK is
    "remote operational error" (IBV_WC_REM_OP_ERR at the requester) and both go to ERR."""
    a, b = res.pair(RC)
    mr = res.mr()
    b.post_recv(RecvWR(wr_id=5, sg=[SGE(mr.buf, 64, mr.lkey ^ 0x5A5A00)]))
    a.post_send(send_wr(mr, 100, 8, wr_id=6))
    wcs = poll(res.cq, 2)
    (r,) = by_qp(wcs, b)
    (s,) = by_qp(wcs, a)
    assert (r.wr_id, r.status) == (5, E.IBV_WC_LOC_QP_OP_ERR)
    assert (s.wr_id, s.status) == (6, E.IBV_WC_REM_OP_ERR)
    assert qp_state(a) == qp_state(b) == E.IBV_QPS_ERR


# -- remote errors --------------------------------------------------------------------------

REMOTE_CASES = ["bad-rkey", "no-remote-write", "past-the-end", "before-the-start"]


@pytest.mark.parametrize("case", REMOTE_CASES)
def test_remote_access_error_on_write(res, case):
    a, b = res.pair(RC)
    local = res.mr()
    remote = res.mr(4096, LW | RR) if case == "no-remote-write" else res.mr(4096)
    rkey, addr = remote.rkey, remote.buf + 64
    if case == "bad-rkey":
        rkey ^= 0x5A5A00
    elif case == "past-the-end":
        addr = remote.buf + 4096 - 4
    elif case == "before-the-start":
        addr = remote.buf - 8
    remote.write(b"\x11" * 4096, 4096, 0)
    wr = send_wr(local, 0, 16, wr_id=1, opcode=E.IBV_WR_RDMA_WRITE)
    wr.set_wr_rdma(rkey, addr)
    a.post_send(wr)
    wcs = poll(res.cq, 1)
    assert [(w.wr_id, w.status) for w in wcs] == [(1, E.IBV_WC_REM_ACCESS_ERR)]
    assert qp_state(a) == E.IBV_QPS_ERR
    assert qp_state(b) == E.IBV_QPS_ERR  # class C at the responder too
    assert remote.read(4096, 0) == b"\x11" * 4096  # nothing written
    # the requester's later WRs flush
    a.post_send(send_wr(local, 0, 8, wr_id=2))
    assert [(w.wr_id, w.status) for w in poll(res.cq, 1)] == [(2, FLUSH)]


@pytest.mark.parametrize("op", ["read", "atomic"])
def test_remote_access_error_on_read_and_atomic_without_the_right(res, op):
    a, b = res.pair(RC)
    local = res.mr()
    remote = res.mr(4096, LW)  # neither REMOTE_READ nor REMOTE_ATOMIC
    if op == "read":
        wr = send_wr(local, 0, 16, wr_id=1, opcode=E.IBV_WR_RDMA_READ)
        wr.set_wr_rdma(remote.rkey, remote.buf)
    else:
        wr = send_wr(local, 0, 8, wr_id=1, opcode=E.IBV_WR_ATOMIC_FETCH_AND_ADD)
        wr.set_wr_atomic(remote.rkey, remote.buf, 1)
    a.post_send(wr)
    (wc,) = poll(res.cq, 1)
    assert (wc.wr_id, wc.status) == (1, E.IBV_WC_REM_ACCESS_ERR)
    assert qp_state(a) == E.IBV_QPS_ERR
    assert remote.read(8, 0) == bytes(8)


def test_receive_too_small(res, differs):
    """A SEND longer than the receive WQE: both sides complete in error and go to ERR; the
    statuses are a recorded difference (conftest DIFFERENCES["recv_too_small"])."""
    a, b = res.pair(RC)
    mr = res.mr()
    b.post_recv(recv_wr(mr, 2048, 16, wr_id=1))
    a.post_send(send_wr(mr, 0, 64, wr_id=2))
    wcs = poll(res.cq, 2)
    (s,) = by_qp(wcs, a)
    (r,) = by_qp(wcs, b)
    want_s, want_r = (getattr(E, n) for n in differs("recv_too_small"))
    assert (s.wr_id, s.status) == (2, want_s)
    assert (r.wr_id, r.status) == (1, want_r)
    assert qp_state(a) == qp_state(b) == E.IBV_QPS_ERR
    assert mr.read(16, 2048 + 16) == bytes(16)  # nothing past the receive buffer


# -- flush ----------------------------------------------------------------------------------

@ALL3
def test_moving_to_err_flushes_both_queues_in_order(res, qpt, differs):
    scq, rcq = res.cq_(), res.cq_()
    qp = res.qp(qpt, scq=scq, rcq=rcq)
    res.to_init(qp)
    for i in range(3):
        qp.post_recv(RecvWR(wr_id=10 + i))
    qp.modify(QPAttr(qp_state=E.IBV_QPS_ERR), M.IBV_QP_STATE)
    assert [(w.wr_id, w.status) for w in poll(rcq, 3)] == [(10, FLUSH), (11, FLUSH),
                                                            (12, FLUSH)]
    # posted in ERR: a send completes (flushed) at once, signaled or not; a receive too
    # where the device flushes receives posted in ERR (differences: recv_posted_in_err)
    mr = res.mr()
    qp.post_recv(RecvWR(wr_id=20))
    wr = SendWR(wr_id=21, sg=[SGE(mr.buf, 8, mr.lkey)], send_flags=0)
    if qpt == UD:
        wr.set_wr_ud(res.ah(), qp.qp_num, QKEY)
    qp.post_send(wr)
    (s,) = poll(scq, 1)
    assert (s.wr_id, s.status) == (21, FLUSH)
    if differs("recv_posted_in_err") == "flushed at once":
        (r,) = poll(rcq, 1)
        assert (r.wr_id, r.status) == (20, FLUSH)


# -- RNR ------------------------------------------------------------------------------------

def test_rnr_retry_until_a_receive_is_posted(res):
    """No receive at b: b answers RNR NAK (min_rnr_timer 12 = 0.64 ms) and a retries
    (rnr_retry 7: without limit) until the receive is there; then the SEND succeeds."""
    a, b = res.pair(RC, min_rnr_timer=12, rnr_retry=7)
    mr = res.mr()
    mr.write(b"patience", 8, 0)
    a.post_send(send_wr(mr, 0, 8, wr_id=1))
    poll_none(res.cq, 0.3)  # a SEND cannot complete without a receive
    assert qp_state(a) == E.IBV_QPS_RTS
    b.post_recv(recv_wr(mr, 1024, 64, wr_id=2))
    wcs = poll(res.cq, 2)
    assert sorted((w.wr_id, w.status) for w in wcs) == [(1, OK), (2, OK)]
    assert mr.read(8, 1024) == b"patience"


def test_rnr_retry_exceeded(res):
    """rnr_retry 0: the first RNR NAK ends the SEND with IBV_WC_RNR_RETRY_EXC_ERR and the
    requester goes to ERR; the responder is unharmed."""
    a, b = res.pair(RC, min_rnr_timer=1, rnr_retry=0)
    mr = res.mr()
    a.post_send(send_wr(mr, 0, 8, wr_id=1))
    a.post_send(send_wr(mr, 0, 8, wr_id=2, flags=0))
    wcs = poll(res.cq, 2)
    assert [(w.wr_id, w.status) for w in wcs] == [(1, E.IBV_WC_RNR_RETRY_EXC_ERR), (2, FLUSH)]
    assert qp_state(a) == E.IBV_QPS_ERR
    assert qp_state(b) == E.IBV_QPS_RTS


def test_uc_and_ud_drop_a_message_without_a_receive(res):
    """Unreliable transports: no receive, no RNR; the sender completes, nothing arrives,
    and the next message is received normally."""
    for qpt in (UC, UD):
        a, b = res.pair(qpt)
        mr = res.mr()
        wr = send_wr(mr, 0, 8, wr_id=1)
        if qpt == UD:
            wr.set_wr_ud(res.ah(), b.qp_num, QKEY)
        a.post_send(wr)
        assert [(w.wr_id, w.status) for w in poll(res.cq, 1)] == [(1, OK)]
        poll_none(res.cq, 0.1)
        b.post_recv(recv_wr(mr, 1024, 128, wr_id=2))
        wr.wr_id = 3
        a.post_send(wr)
        wcs = poll(res.cq, 2)
        assert sorted((w.wr_id, w.status) for w in wcs) == [(2, OK), (3, OK)]
        assert qp_state(b) == E.IBV_QPS_RTS


# -- opcodes the transport cannot carry, memory windows -------------------------------------

def test_uc_send_with_invalidate_fails_at_the_requester(res, differs):
    """rxe's WR table lets UC post SEND_WITH_INV, but its UC requester has no opcode for it:
    IBV_WC_LOC_QP_OP_ERR, and the QP goes to ERR."""
    a, b = res.pair(UC)
    mr = res.mr()
    b.post_recv(recv_wr(mr, 1024, 64, wr_id=1))
    wr = send_wr(mr, 0, 8, wr_id=2, opcode=E.IBV_WR_SEND_WITH_INV)
    wr.invalidate_rkey = mr.rkey
    a.post_send(wr)
    (wc,) = poll(res.cq, 1)
    assert (wc.wr_id, wc.status, wc.qp_num) == (2, own_status(differs, E.IBV_WC_LOC_QP_OP_ERR),
                                                 a.qp_num)
    assert qp_state(a) == E.IBV_QPS_ERR
    assert qp_state(b) == E.IBV_QPS_RTS


def test_mw_bind_to_an_mr_without_mw_bind_access(res, differs):
    a, _ = res.pair(RC)
    mr = res.mr(4096, LW | RR)  # no IBV_ACCESS_MW_BIND
    mw = res.keep(MW(res.pd, E.IBV_MW_TYPE_2))
    bind = SendWR(wr_id=1, opcode=E.IBV_WR_BIND_MW, send_flags=E.IBV_SEND_SIGNALED)
    bind.set_bind_wr(mw, MWBindInfo(mr, mr.buf, 64, RR))
    a.post_send(bind)
    (wc,) = poll(res.cq, 1)
    assert (wc.wr_id, wc.status) == (1, own_status(differs, E.IBV_WC_MW_BIND_ERR))
    assert qp_state(a) == E.IBV_QPS_ERR


def test_type2_window_works_only_through_its_qp(res):
    """A type 2 window is bound to the QP that bound it: the same rkey through another
    connection is a remote access error."""
    a, b = res.pair(RC)
    a2, b2 = res.pair(RC)
    local = res.mr()
    target = res.mr(4096, LW | RR | E.IBV_ACCESS_MW_BIND)
    mw = res.keep(MW(res.pd, E.IBV_MW_TYPE_2))
    bind = SendWR(wr_id=1, opcode=E.IBV_WR_BIND_MW, send_flags=E.IBV_SEND_SIGNALED)
    bind.set_bind_wr(mw, MWBindInfo(target, target.buf, 4096, RR))
    b.post_send(bind)
    assert [(w.wr_id, w.status) for w in poll(res.cq, 1)] == [(1, OK)]
    for qp, wr_id, status in ((a, 2, OK), (a2, 3, E.IBV_WC_REM_ACCESS_ERR)):
        wr = send_wr(local, 0, 8, wr_id=wr_id, opcode=E.IBV_WR_RDMA_READ)
        wr.set_wr_rdma(bind.bind_rkey, target.buf)
        qp.post_send(wr)
        assert [(w.wr_id, w.status) for w in poll(res.cq, 1)] == [(wr_id, status)]


def test_mr_with_a_bound_window_cannot_be_deregistered(res):
    a, _ = res.pair(RC)
    mr = res.mr(4096, LW | RR | E.IBV_ACCESS_MW_BIND)
    mw = MW(res.pd, E.IBV_MW_TYPE_1)
    a.bind_mw(mw, MWBind(MWBindInfo(mr, mr.buf, 64, RR), E.IBV_SEND_SIGNALED, 9))
    assert [(w.wr_id, w.status) for w in poll(res.cq, 1)] == [(9, OK)]
    raises_errno(errno.EINVAL, mr.close)  # rxe_dereg_mr: windows still bound
    mw.close()
    mr.close()
