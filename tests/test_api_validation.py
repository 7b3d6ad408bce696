"""Validation at the verbs boundary and fault containment in the data path.

What must hold: every field of every WR, attribute object and object argument is checked
where the user passes it, failing with PyverbsRDMAError (the errno libibverbs would give)
naming the field and leaving queues and QP state untouched; and an unexpected exception
inside one QP's engine moves that QP alone to ERR (flushed WRs, IBV_EVENT_QP_FATAL, a
``qp_fatal`` count, one log record) while the device and every other QP go on.

The devices run in manual mode: the default loopback transport queues packets, and
``device.progress()`` delivers them and fires due timers, so every test is deterministic.
Expected values are the C widths of the libibverbs structs (uint64_t remote_addr,
uint32_t rkey...), the errnos of rxe/uverbs, and data written by the test itself.
"""

from __future__ import annotations

import errno
import logging
import os
import types

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from softrdma.errors import PyverbsRDMAError
from softrdma.qp.completer import Completer
from softrdma.qp.requester import Requester
from softrdma.qp.responder import Responder
from softrdma.verbs_api import (
    AH, CQ, GID, MR, MW, PD, QP, SGE, SRQ, AHAttr, CompChannel, Context, GlobalRoute,
    MWBindInfo, QPAttr, QPCap, QPInitAttr, RecvWR, SendWR, SrqAttr, SrqInitAttr, add_device,
    remove_device,
)
from softrdma.verbs_api import enums as E

from .datapath_helpers import Wire
from .verbs_helpers import RC, RESET, RTS, UD, loopback_av

A = E.ibv_access_flags
W = E.ibv_wr_opcode
ALL_ACCESS = int(A.IBV_ACCESS_LOCAL_WRITE | A.IBV_ACCESS_REMOTE_WRITE | A.IBV_ACCESS_REMOTE_READ
                 | A.IBV_ACCESS_REMOTE_ATOMIC | A.IBV_ACCESS_MW_BIND)
DEV_NAME = "softrdma-validate"
DEV_IP = "127.0.0.11"
MIB = 1 << 20


@pytest.fixture(scope="module")
def dev():
    d = add_device(DEV_IP, name=DEV_NAME, live=False)  # stepped with progress()
    yield d
    remove_device(DEV_NAME)


@pytest.fixture
def ctx(dev):
    with Context(name=DEV_NAME) as c:
        yield c


def drain(device, limit: int = 100_000) -> None:
    """Deliver every looped-back packet and due timer (manual mode)."""
    for _ in range(limit):
        if not device.progress():
            return
    raise AssertionError("progress() never went idle")


def connect(ctx, qp, peer_qpn: int, **override) -> None:
    """RESET -> RTS towards ``peer_qpn`` on this device; ``override`` replaces attributes."""
    a = QPAttr()
    a.port_num, a.pkey_index, a.qkey = 1, 0, 0x11111111
    a.qp_access_flags = ALL_ACCESS & 0xF
    a.ah_attr = loopback_av(ctx)
    a.path_mtu = E.IBV_MTU_1024
    a.dest_qp_num = peer_qpn
    a.rq_psn = a.sq_psn = 0
    a.max_dest_rd_atomic = a.max_rd_atomic = 1
    a.min_rnr_timer, a.timeout, a.retry_cnt, a.rnr_retry = 12, 14, 7, 7
    for k, v in override.items():
        setattr(a, k, v)
    qp.to_rts(a)


class Net:
    """One PD, CQ and registered MR, and connected RC pairs on the test device."""

    def __init__(self, ctx, mr_len: int = 4096) -> None:
        self.ctx = ctx
        self.dev = ctx.device
        self.pd = PD(ctx)
        self.cq = CQ(ctx, 4096)
        self.mr = MR(self.pd, mr_len, ALL_ACCESS)

    def qp(self, qpt: int = RC, **cap) -> QP:
        c = QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=2, max_recv_sge=2)
        for k, v in cap.items():
            setattr(c, k, v)
        return QP(self.pd, QPInitAttr(qp_type=qpt, scq=self.cq, rcq=self.cq, cap=c))

    def pair(self) -> tuple[QP, QP]:
        a, b = self.qp(), self.qp()
        connect(self.ctx, a, b.qp_num)
        connect(self.ctx, b, a.qp_num)
        return a, b

    def write_wr(self, wr_id: int, length: int, src_off: int = 0, dst_off: int = 0) -> SendWR:
        wr = SendWR(wr_id=wr_id, opcode=W.IBV_WR_RDMA_WRITE,
                    sg=[SGE(self.mr.buf + src_off, length, self.mr.lkey)])
        wr.set_wr_rdma(self.mr.rkey, self.mr.buf + dst_off)
        return wr

    def completions(self) -> dict[int, int]:
        """wr_id -> status of every completion now in the CQ."""
        return {wc.wr_id: wc.status for wc in self.cq.poll_all()}


def expect_einval(fn, *tokens: str, code: int = errno.EINVAL) -> PyverbsRDMAError:
    with pytest.raises(PyverbsRDMAError) as ei:
        fn()
    e = ei.value
    assert e.error_code == code, str(e)
    for t in tokens:
        assert t in str(e), f"{t!r} not named in: {e}"
    return e


def events(ctx) -> list:
    out = []
    while (ev := ctx.get_async_event(block=False)) is not None:
        out.append(ev)
    return out


# -- the device-killing WR (finding 1) -----------------------------------------------------

def test_out_of_range_remote_addr_is_einval_and_the_device_goes_on(ctx):
    n = Net(ctx, mr_len=4 * MIB)
    a1, a2 = n.pair()
    b1, b2 = n.pair()
    payload = os.urandom(MIB)
    n.mr.write(payload, MIB, 0)
    a1.post_send(n.write_wr(1, MIB, 0, MIB))  # valid, 1 MiB, starts at once
    queued = len(a1.sq)
    bad = n.write_wr(2, 64)
    bad.remote_addr = 1 << 64
    e = expect_einval(lambda: a1.post_send(bad), "wr[0].remote_addr", str(1 << 64))
    assert e.bad_wr is bad and e.bad_wr_index == 0
    assert len(a1.sq) == queued  # the rejected WR is not in the queue
    # in a list the failing WR is named by its index; the WR before it stays posted
    bad2 = n.write_wr(4, 64)
    bad2.remote_addr = 1 << 64
    expect_einval(lambda: a1.post_send([n.write_wr(3, 64, 0, 3 * MIB), bad2]),
                  "wr[1].remote_addr 18446744073709551616 is not a 64-bit address")
    assert len(a1.sq) == queued + 1
    b1.post_send(n.write_wr(10, 4096, 0, 2 * MIB))
    drain(n.dev)
    assert n.completions() == {1: E.IBV_WC_SUCCESS, 3: E.IBV_WC_SUCCESS, 10: E.IBV_WC_SUCCESS}
    assert n.mr.read(MIB, MIB) == payload
    assert n.mr.read(4096, 2 * MIB) == payload[:4096]
    assert a1.qp_state == b1.qp_state == RTS
    # the QP that refused the bad WR still works
    a1.post_send(n.write_wr(11, 64, 0, 3 * MIB))
    drain(n.dev)
    assert n.completions() == {11: E.IBV_WC_SUCCESS}


BAD_SEND_FIELDS = [
    # (attribute, value, token the message must contain)
    ("remote_addr", -1, "wr[0].remote_addr -1"),
    ("remote_addr", "0x1000", "wr[0].remote_addr must be an int"),
    ("remote_addr", None, "wr[0].remote_addr must be an int, not None"),
    ("remote_addr", 4096.0, "wr[0].remote_addr must be an int, not a float"),
    ("rkey", 1 << 32, "wr[0].rkey 4294967296 is not a 32-bit key"),
    ("rkey", -1, "wr[0].rkey -1"),
    ("rkey", True, "wr[0].rkey"),
    ("compare_add", 1 << 64, "wr[0].compare_add"),
    ("swap", -1, "wr[0].swap"),
    ("imm_data", 1 << 32, "wr[0].imm_data"),
    ("wr_id", -1, "wr[0].wr_id"),
    ("wr_id", 1 << 64, "wr[0].wr_id"),
    ("wr_id", "one", "wr[0].wr_id"),
    ("opcode", "RDMA_WRITE", "wr[0].opcode"),
    ("opcode", [0], "wr[0].opcode"),
    ("send_flags", 1 << 40, "wr[0].send_flags has unknown send_flags bits 0x10000000000"),
    ("send_flags", None, "wr[0].send_flags"),
    ("num_sge", "1", "wr[0].num_sge"),
    ("sg_list", None, "wr[0].sg_list"),
    ("sg_list", 5, "wr[0].sg_list"),
    ("sg_list", [("addr", 1, 2)], "wr[0].sg_list[0] is a tuple, not an SGE"),
]


@pytest.mark.parametrize("field,value,token", BAD_SEND_FIELDS,
                         ids=[f"{f}={v!r}" for f, v, _ in BAD_SEND_FIELDS])
def test_post_send_refuses_bad_fields_by_name(ctx, field, value, token):
    n = Net(ctx)
    a, _ = n.pair()
    wr = n.write_wr(1, 8)
    if field in ("compare_add", "swap"):
        wr = SendWR(wr_id=1, opcode=W.IBV_WR_ATOMIC_FETCH_AND_ADD,
                    sg=[SGE(n.mr.buf, 8, n.mr.lkey)])
        wr.set_wr_atomic(n.mr.rkey, n.mr.buf + 64, 1, 0)
    setattr(wr, field, value)
    expect_einval(lambda: a.post_send(wr), token)
    assert len(a.sq) == 0 and a.qp_state == RTS
    a.post_send(n.write_wr(2, 8, 0, 128))
    drain(n.dev)
    assert n.completions() == {2: E.IBV_WC_SUCCESS}


@pytest.mark.parametrize("field,value", [("addr", 1 << 64), ("addr", -8), ("length", -1),
                                         ("length", 1 << 32), ("lkey", 1 << 32),
                                         ("lkey", "key"), ("addr", None)])
def test_post_send_and_recv_refuse_bad_sges(ctx, field, value):
    n = Net(ctx)
    a, b = n.pair()
    sge = SGE(n.mr.buf, 8, n.mr.lkey)
    setattr(sge, field, value)
    wr = SendWR(wr_id=1, opcode=W.IBV_WR_RDMA_WRITE, sg=[SGE(n.mr.buf, 8, n.mr.lkey), sge])
    wr.set_wr_rdma(n.mr.rkey, n.mr.buf)
    expect_einval(lambda: a.post_send(wr), f"wr[0].sg_list[1].{field}")
    expect_einval(lambda: b.post_recv(RecvWR(wr_id=1, sg=[sge])), f"wr[0].sg_list[0].{field}")
    assert len(a.sq) == 0 and len(b.rq) == 0


def test_none_and_wrong_classes_are_einval(ctx):
    n = Net(ctx)
    a, b = n.pair()
    expect_einval(lambda: a.post_send(None), "wr is None")
    expect_einval(lambda: a.post_send([]), "empty list")
    expect_einval(lambda: b.post_recv(None), "wr is None")
    expect_einval(lambda: a.post_send(RecvWR(sg=[])), "wr[0] is a RecvWR, not a SendWR")
    expect_einval(lambda: b.post_recv(n.write_wr(1, 8)), "wr[0] is a SendWR, not a RecvWR")
    expect_einval(lambda: b.post_recv(RecvWR(wr_id=1, sg=None)), "wr[0].sg_list")
    expect_einval(lambda: a.post_send(SendWR(opcode=W.IBV_WR_RDMA_WRITE, sg=None)),
                  "wr[0].sg_list")
    expect_einval(lambda: a.post_send(n.write_wr(1, 8), bad_wr=5), "bad_wr")
    # next_wr that is not a WR: the WR before it is posted, the junk is named by index
    wr = n.write_wr(7, 8)
    wr.next_wr = "junk"
    e = expect_einval(lambda: a.post_send(wr), "wr[1] is a str, not a SendWR")
    assert e.bad_wr_index == 1
    drain(n.dev)
    assert n.completions() == {7: E.IBV_WC_SUCCESS}
    # leaving sg out is still a zero-length message (softrdma's documented convenience)
    a.post_send(SendWR(wr_id=8, opcode=W.IBV_WR_RDMA_WRITE))
    drain(n.dev)
    assert n.completions() == {8: E.IBV_WC_SUCCESS}


def test_ud_fields(ctx):
    n = Net(ctx)
    u = n.qp(UD)
    u.to_rts(QPAttr(qkey=0x11111111, sq_psn=0))
    ah = AH(n.pd, attr=loopback_av(ctx))
    for field, value, token in (("ah", n.pd, "wr[0].ah is a PD, not an AH"),
                                ("remote_qpn", 1 << 24, "wr[0].remote_qpn"),
                                ("remote_qkey", 1 << 32, "wr[0].remote_qkey"),
                                ("remote_qkey", None, "wr[0].remote_qkey")):
        wr = SendWR(wr_id=1, sg=[SGE(n.mr.buf, 8, n.mr.lkey)])
        wr.set_wr_ud(ah, u.qp_num, 0x11111111)
        setattr(wr, field, value)
        expect_einval(lambda: u.post_send(wr), token)
    assert len(u.sq) == 0


def test_bind_wr_fields(ctx):
    n = Net(ctx)
    a, _ = n.pair()
    mw = MW(n.pd, E.IBV_MW_TYPE_2)
    good = dict(mr=n.mr, addr=n.mr.buf, length=64, mw_access_flags=int(A.IBV_ACCESS_REMOTE_READ))
    for field, value in (("addr", -1), ("length", 1 << 64), ("mw_access_flags", 1 << 40),
                         ("mr", n.pd), ("addr", "0")):
        wr = SendWR(wr_id=1, opcode=W.IBV_WR_BIND_MW)
        wr.set_bind_wr(mw, MWBindInfo(**{**good, field: value}))
        expect_einval(lambda: a.post_send(wr), f"wr[0].bind_info.{field}")
    wr = SendWR(wr_id=1, opcode=W.IBV_WR_BIND_MW)
    wr.set_bind_wr(n.cq, MWBindInfo(**good))  # no rkey to increment: refused at post
    expect_einval(lambda: a.post_send(wr), "wr[0].mw is a CQ, not an MW")
    assert len(a.sq) == 0


# -- object arguments: the PD-as-CQ (finding 1) -------------------------------------------

def test_pd_as_cq_is_refused_at_qp_creation(ctx):
    n = Net(ctx)
    mk = lambda **kw: QP(n.pd, QPInitAttr(**{"qp_type": RC, "scq": n.cq, "rcq": n.cq, **kw}))  # noqa: E731
    expect_einval(lambda: mk(scq=n.pd), "init_attr.scq is a PD, not a CQ")
    expect_einval(lambda: mk(rcq=n.mr), "init_attr.rcq is an MR, not a CQ")
    expect_einval(lambda: mk(srq=n.cq), "init_attr.srq is a CQ, not an SRQ")
    expect_einval(lambda: mk(cap=5), "init_attr.cap")
    expect_einval(lambda: mk(cap=QPCap(max_send_wr="16")), "init_attr.cap.max_send_wr")
    expect_einval(lambda: mk(qp_type=None), "init_attr.qp_type")
    expect_einval(lambda: mk(sq_sig_all="yes"), "init_attr.sq_sig_all")
    expect_einval(lambda: QP(n.cq, QPInitAttr(qp_type=RC, scq=n.cq, rcq=n.cq)),
                  "pd is a CQ, not a PD")
    expect_einval(lambda: QP(n.pd, {"qp_type": RC}), "init_attr is a dict")
    assert not [c for c in ctx.children if isinstance(c, QP)]
    # ... and the valid QP of the same call works end to end
    a, _ = n.pair()
    a.post_send(n.write_wr(1, 8))
    drain(n.dev)
    assert n.completions() == {1: E.IBV_WC_SUCCESS}


def test_objects_of_the_wrong_class(ctx):
    n = Net(ctx)
    expect_einval(lambda: PD(None), "context is None, not a Context")
    expect_einval(lambda: CQ(n.pd, 10), "context is a PD, not a Context")
    expect_einval(lambda: CQ(ctx, "10"), "cqe")
    expect_einval(lambda: CQ(ctx, 10, None, n.cq), "channel is a CQ, not a CompChannel")
    expect_einval(lambda: CompChannel(n.pd), "context")
    expect_einval(lambda: MR(ctx, 64, 0), "pd is a Context, not a PD")
    expect_einval(lambda: MW(n.pd, "1"), "mw_type")
    expect_einval(lambda: SRQ(n.pd, None), "init_attr is None")
    expect_einval(lambda: SRQ(n.pd, SrqInitAttr(attr=SrqAttr(max_wr=1.5))), "init_attr.attr.max_wr")
    expect_einval(lambda: AH(n.pd, attr=AHAttr(is_global=1, gr=GlobalRoute(
        dgid=ctx.query_gid(1, 1), sgid_index="1"))), "attr.gr.sgid_index")
    expect_einval(lambda: AH(n.pd, attr=AHAttr(is_global=1, gr=n.pd)), "attr.gr is a PD")


# -- unknown bits and wrong types (finding 4) ----------------------------------------------

def test_unknown_attr_mask_bits_are_refused_and_change_nothing(ctx):
    n = Net(ctx)
    qp = n.qp()
    a = QPAttr(qp_state=E.IBV_QPS_INIT, port_num=1, pkey_index=0, qp_access_flags=0)
    ok = int(E.IBV_QP_STATE | E.IBV_QP_PORT | E.IBV_QP_PKEY_INDEX | E.IBV_QP_ACCESS_FLAGS)
    for bit in (1 << 21, 1 << 26, 1 << 31, 1 << 40):
        # uverbs refuses bits outside IB_QP_ATTR_STANDARD_BITS with EOPNOTSUPP
        expect_einval(lambda: qp.modify(a, ok | bit), f"0x{bit:x}", code=errno.EOPNOTSUPP)
        assert qp.qp_state == RESET
    expect_einval(lambda: qp.modify(a, "1"), "attr_mask")
    expect_einval(lambda: qp.modify(a, -1), "attr_mask")
    expect_einval(lambda: qp.modify(None, ok), "attr is None, not a QPAttr")
    a.qp_access_flags = 1 << 40
    expect_einval(lambda: qp.modify(a, ok), "attr.qp_access_flags has unknown access flags")
    assert qp.qp_state == RESET
    srq = SRQ(n.pd, SrqInitAttr(attr=SrqAttr(max_wr=16, max_sge=1)))
    expect_einval(lambda: srq.modify(SrqAttr(), 1 << 40), "attr_mask has unknown mask bits")


def test_unknown_access_bits_and_bad_mr_arguments(ctx):
    n = Net(ctx)
    expect_einval(lambda: MR(n.pd, 10, 1 << 40), "access has unknown access flags 0x10000000000")
    expect_einval(lambda: MR(n.pd, 10, 1 << 21), "access has unknown access flags 0x200000")
    expect_einval(lambda: MR(n.pd, 10, "1"), "access")
    expect_einval(lambda: MR(n.pd, 10, 0, address=-4096), "address -4096")
    expect_einval(lambda: MR(n.pd, 10, 0, address="0x1000"), "address must be an int, not a str")
    expect_einval(lambda: MR(n.pd, 10, 0, address=(1 << 64) - 4), "wraps past 2^64")
    expect_einval(lambda: MR(n.pd, "10", 0), "length")
    expect_einval(lambda: MR(n.pd, -1, 0), "length -1")
    expect_einval(lambda: MR(n.pd, 1 << 50), "length", code=errno.ENOMEM)
    expect_einval(lambda: n.mr.read("1"), "length")
    expect_einval(lambda: n.mr.write(5), "data")
    mr = MR(n.pd, 16, 0, address=0x1000)  # a valid chosen iova works and prints
    assert mr.buf == 0x1000 and "addr=0x1000" in repr(mr)


@pytest.mark.parametrize("field,value", [
    ("timeout", "14"), ("retry_cnt", None), ("sq_psn", 1 << 24), ("rq_psn", -1),
    ("dest_qp_num", 1 << 24), ("path_mtu", 3.0), ("min_rnr_timer", [12]),
    ("max_rd_atomic", 1 << 8), ("ah_attr", "127.0.0.1"), ("pkey_index", 1 << 16),
    ("port_num", True),
])
def test_modify_names_wrong_types_and_widths(ctx, field, value):
    n = Net(ctx)
    qp, peer = n.qp(), n.qp()
    with pytest.raises(PyverbsRDMAError) as ei:
        connect(ctx, qp, peer.qp_num, **{field: value})
    assert ei.value.error_code == errno.EINVAL and f"attr.{field}" in str(ei.value)


def test_gid_and_add_device_name_the_bad_value():
    expect_einval(lambda: GID("garbage"), "'garbage'")
    expect_einval(lambda: GID(5), "5 is an int")
    expect_einval(lambda: GlobalRoute(dgid="garbage"), "dgid", "'garbage'")
    expect_einval(lambda: add_device("999.1.1.1"), "'999.1.1.1'")
    assert GID("10.0.0.1").ip == "10.0.0.1"


# -- fault containment (finding 1) -------------------------------------------------------

def _patch_to_raise(monkeypatch, cls, name, victim):
    """Make ``cls.name`` raise for ``victim``'s engine only (every class has __slots__,
    so patch the class and test which QP is running)."""
    orig = getattr(cls, name)

    def boom(self, *args, **kw):
        if self.qp is victim.engine:  # the engines see the QP as its engine
            raise RuntimeError(f"injected fault in {cls.__name__}.{name}")
        return orig(self, *args, **kw)
    monkeypatch.setattr(cls, name, boom)


def _check_contained(ctx, n, victim, others, caplog, before: int) -> None:
    assert victim.qp_state == E.IBV_QPS_ERR
    assert all(q.qp_state == RTS for q in others)
    assert n.dev.counters.qp_fatal == before + 1
    evs = events(ctx)
    fatal = [e for e in evs if e.event_type == E.IBV_EVENT_QP_FATAL]
    assert len(fatal) == 1 and fatal[0].element is victim
    recs = [r for r in caplog.records if r.name == "softrdma" and r.levelno >= logging.ERROR]
    assert len(recs) == 1 and f"0x{victim.qp_num:x}" in recs[0].getMessage()
    assert recs[0].exc_info is not None  # the traceback is kept for whoever reads the log


def test_requester_fault_moves_only_its_qp_to_err(ctx, monkeypatch, caplog):
    n = Net(ctx)
    a1, a2 = n.pair()
    b1, b2 = n.pair()
    events(ctx)
    before = n.dev.counters.qp_fatal
    _patch_to_raise(monkeypatch, Requester, "_make_packet", a1)
    _patch_to_raise(monkeypatch, Requester, "_send_only", a1)  # the one-packet fast path
    caplog.set_level(logging.ERROR, logger="softrdma")
    a1.post_send([n.write_wr(1, 64), n.write_wr(2, 64)])  # posted: the fault is the QP's
    _check_contained(ctx, n, a1, [a2, b1, b2], caplog, before)
    b1.post_send(n.write_wr(3, 64, 0, 1024))
    drain(n.dev)
    assert n.completions() == {1: E.IBV_WC_WR_FLUSH_ERR, 2: E.IBV_WC_WR_FLUSH_ERR,
                               3: E.IBV_WC_SUCCESS}
    # later WRs on the faulted QP flush at once, like any QP in ERR
    a1.post_send(n.write_wr(4, 8))
    assert n.completions() == {4: E.IBV_WC_WR_FLUSH_ERR}


def test_responder_fault_on_receive_moves_only_its_qp_to_err(ctx, monkeypatch, caplog):
    n = Net(ctx)
    a1, a2 = n.pair()
    b1, b2 = n.pair()
    a2.post_recv(RecvWR(wr_id=50, sg=[SGE(n.mr.buf + 2048, 64, n.mr.lkey)]))
    events(ctx)
    before = n.dev.counters.qp_fatal
    _patch_to_raise(monkeypatch, Responder, "_execute", a2)
    caplog.set_level(logging.ERROR, logger="softrdma")
    a1.post_send(n.write_wr(1, 64))
    b1.post_send(n.write_wr(2, 64, 0, 1024))
    drain(n.dev)  # the receive path survives the fault and goes on to b2's packet
    _check_contained(ctx, n, a2, [b1, b2, a1], caplog, before)
    assert n.completions() == {50: E.IBV_WC_WR_FLUSH_ERR, 2: E.IBV_WC_SUCCESS}


def test_timer_fault_moves_only_its_qp_to_err(ctx, monkeypatch, caplog):
    n = Net(ctx)
    a1, a2 = n.pair()
    b1, b2 = n.pair()
    events(ctx)
    before = n.dev.counters.qp_fatal
    wire = Wire(n.dev, drop=lambda i, p: p.dest_qp == a2.qp_num)  # a1's request is lost
    try:
        a1.post_send(n.write_wr(1, 64))
        drain(n.dev)
        _patch_to_raise(monkeypatch, Completer, "on_timeout", a1)
        caplog.set_level(logging.ERROR, logger="softrdma")
        n.dev.now += 60  # past a1's retransmit timeout
        drain(n.dev)  # terminates: the faulted QP's timer is disarmed
    finally:
        wire.restore()
    _check_contained(ctx, n, a1, [a2, b1, b2], caplog, before)
    assert a1 not in n.dev.timer_qps
    b1.post_send(n.write_wr(2, 64, 0, 1024))
    drain(n.dev)
    assert n.completions() == {1: E.IBV_WC_WR_FLUSH_ERR, 2: E.IBV_WC_SUCCESS}


# -- hypothesis: anything into every constructor and post call ---------------------------

class _Other:
    """An object of no verbs class."""


def _anything(objs) -> st.SearchStrategy:
    ints = st.one_of(st.integers(), st.integers(min_value=-(1 << 70), max_value=1 << 70),
                     st.sampled_from([0, 1, 7, 8, -1, (1 << 8), (1 << 16), (1 << 20), (1 << 24) - 1,
                                      1 << 24, (1 << 31), (1 << 32) - 1, 1 << 32, (1 << 63),
                                      (1 << 64) - 1, 1 << 64, 1 << 200]))
    return st.one_of(ints, st.floats(), st.text(max_size=20), st.binary(max_size=40), st.none(),
                     st.booleans(), st.lists(st.integers(), max_size=3), st.builds(_Other),
                     st.sampled_from(objs))


_PHYS = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _no_big_alloc(v) -> None:
    # a valid length between 64 KiB and the machine's memory would really be allocated
    assume(not (isinstance(v, int) and (1 << 16) < v <= _PHYS))


def _wr(o, **kw) -> SendWR:
    wr = SendWR(wr_id=1, opcode=W.IBV_WR_RDMA_WRITE, sg=[SGE(o.mr.buf, 8, o.mr.lkey)])
    wr.set_wr_rdma(o.mr.rkey, o.mr.buf + 256)
    for k, v in kw.items():
        setattr(wr, k, v)
    return wr


def _sge_wr(o, field, v) -> SendWR:
    s = SGE(o.mr.buf, 8, o.mr.lkey)
    setattr(s, field, v)
    return _wr(o, sg_list=[s])


def _ud(o, field, v):
    u = o.net.qp(UD)
    u.to_rts(QPAttr(qkey=1, sq_psn=0))
    wr = SendWR(wr_id=1, sg=[SGE(o.mr.buf, 8, o.mr.lkey)])
    wr.set_wr_ud(AH(o.pd, attr=loopback_av(o.ctx)), u.qp_num, 1)
    setattr(wr, field, v)
    u.post_send(wr)


def _bind(o, field, v):
    mw = MW(o.pd, E.IBV_MW_TYPE_2)
    info = MWBindInfo(mr=o.mr, addr=o.mr.buf, length=64, mw_access_flags=4)
    wr = SendWR(wr_id=1, opcode=W.IBV_WR_BIND_MW)
    if field == "mw":
        wr.set_bind_wr(v, info)
    else:
        setattr(info, field, v)
        wr.set_bind_wr(mw, info)
    o.a.post_send(wr)


def _create_qp(o, field, v):
    ia = QPInitAttr(qp_type=RC, scq=o.cq, rcq=o.cq, cap=QPCap(max_send_wr=4, max_recv_wr=4))
    if field.startswith("cap."):
        setattr(ia.cap, field[4:], v)
    else:
        setattr(ia, field, v)
    QP(o.pd, ia)


def _ah(o, field, v):
    attr = loopback_av(o.ctx)
    if field.startswith("gr."):
        setattr(attr.gr, field[3:], v)
    else:
        setattr(attr, field, v)
    AH(o.pd, attr=attr)


def _srq_create(o, field, v):
    SRQ(o.pd, SrqInitAttr(attr=SrqAttr(**{"max_wr": 16, "max_sge": 1, field: v})))


def _srq(o):
    return SRQ(o.pd, SrqInitAttr(attr=SrqAttr(max_wr=16, max_sge=1)))


def _mr_length(o, v):
    _no_big_alloc(v)
    MR(o.pd, v, 1)


# (name, call(o, v), tokens: the message must contain one of them, case-insensitively)
TARGETS = [
    ("post_send(wr)", lambda o, v: o.a.post_send(v), ("wr",)),
    ("post_send bad_wr", lambda o, v: o.a.post_send(_wr(o), bad_wr=v), ("bad_wr",)),
    *[(f"SendWR.{f}", (lambda f: lambda o, v: o.a.post_send(_wr(o, **{f: v})))(f), (t,))
      for f, t in (("wr_id", "wr_id"), ("opcode", "opcode"), ("num_sge", "num_sge"),
                   ("imm_data", "imm_data"), ("send_flags", "send_flags"),
                   ("remote_addr", "remote_addr"), ("rkey", "rkey"),
                   ("compare_add", "compare_add"), ("swap", "swap"), ("next_wr", "wr[1]"))],
    # num_sge defaults to len(sg): a long list is refused through num_sge
    ("SendWR.sg_list", lambda o, v: o.a.post_send(_wr(o, sg_list=v)), ("sg_list", "num_sge")),
    ("SendWR(sg=)", lambda o, v: o.a.post_send(SendWR(opcode=W.IBV_WR_RDMA_WRITE, sg=v)),
     ("sg_list", "num_sge")),
    ("set_wr_atomic", lambda o, v: o.a.post_send(_atomic(o, v)), ("compare_add", "remote_addr")),
    *[(f"SGE.{f}", (lambda f: lambda o, v: o.a.post_send(_sge_wr(o, f, v)))(f),
       (f"sg_list[0].{f}", "sg_list[*].length"))
      for f in ("addr", "length", "lkey")],
    *[(f"UD {f}", (lambda f: lambda o, v: _ud(o, f, v))(f), (f"wr[0].{f}",))
      for f in ("ah", "remote_qpn", "remote_qkey")],
    *[(f"bind {f}", (lambda f: lambda o, v: _bind(o, f, v))(f), (f,))
      for f in ("mw", "mr", "addr", "length", "mw_access_flags")],
    ("post_recv(wr)", lambda o, v: o.b.post_recv(v), ("wr",)),
    ("RecvWR.wr_id", lambda o, v: o.b.post_recv(RecvWR(wr_id=v)), ("wr_id",)),
    ("RecvWR(sg=)", lambda o, v: o.b.post_recv(RecvWR(sg=v)), ("sg_list", "num_sge")),
    ("RecvWR.num_sge", lambda o, v: o.b.post_recv(RecvWR(num_sge=v, sg=[SGE(o.mr.buf, 8, 1)])),
     ("num_sge",)),
    ("RecvWR SGE.length", lambda o, v: o.b.post_recv(RecvWR(sg=[SGE(o.mr.buf, v, 1)])),
     ("length",)),
    ("QP(pd)", lambda o, v: QP(v, QPInitAttr(qp_type=RC, scq=o.cq, rcq=o.cq)), ("pd",)),
    ("QP(init_attr)", lambda o, v: QP(o.pd, v), ("init_attr",)),
    ("QP(qp_attr)", lambda o, v: QP(o.pd, QPInitAttr(qp_type=RC, scq=o.cq, rcq=o.cq), v),
     ("qp_attr",)),
    *[(f"QPInitAttr.{f}", (lambda f: lambda o, v: _create_qp(o, f, v))(f), (f,))
      for f in ("qp_type", "scq", "rcq", "srq", "cap", "sq_sig_all", "cap.max_send_wr",
                "cap.max_recv_wr", "cap.max_send_sge", "cap.max_recv_sge",
                "cap.max_inline_data")],
    *[(f"QPAttr.{f}", (lambda f: lambda o, v: connect(o.ctx, o.net.qp(), o.b.qp_num,
                                                      **{f: v}))(f), (f"attr.{f}",))
      for f in ("qp_access_flags", "pkey_index", "port_num", "qkey", "path_mtu", "dest_qp_num",
                "rq_psn", "sq_psn", "max_dest_rd_atomic", "max_rd_atomic", "min_rnr_timer",
                "timeout", "retry_cnt", "rnr_retry", "ah_attr")],
    # a well-formed QPAttr drawn here can still be refused for the mask (a RESET QP needs
    # more than IBV_QP_STATE to reach INIT): that error names the mask's bits
    ("modify(attr)", lambda o, v: o.net.qp().modify(v, 1), ("attr", "IBV_QP_")),
    ("modify(mask)", lambda o, v: o.net.qp().modify(
        QPAttr(qp_state=E.IBV_QPS_INIT, port_num=1), v), ("mask", "IBV_QP_", "transition")),
    *[(f"AHAttr.{f}", (lambda f: lambda o, v: _ah(o, f, v))(f), (f"attr.{f}",))
      for f in ("port_num", "is_global", "dlid", "sl", "src_path_bits", "static_rate", "gr",
                "gr.dgid", "gr.sgid_index", "gr.hop_limit", "gr.traffic_class",
                "gr.flow_label")],
    ("AH(pd)", lambda o, v: AH(v, attr=loopback_av(o.ctx)), ("pd",)),
    ("AH(attr)", lambda o, v: AH(o.pd, attr=v), ("attr",)),
    ("GID", lambda o, v: GID(v), ("GID",)),
    ("GlobalRoute(dgid)", lambda o, v: GlobalRoute(dgid=v), ("dgid",)),
    ("MR(pd)", lambda o, v: MR(v, 64, 1), ("pd",)),
    ("MR(length)", _mr_length, ("length",)),
    ("MR(access)", lambda o, v: MR(o.pd, 64, v), ("access",)),
    ("MR(address)", lambda o, v: MR(o.pd, 64, 1, address=v), ("address",)),
    ("MR(buffer)", lambda o, v: MR(o.pd, access=1, buffer=v), ("buffer",)),
    ("MR.read", lambda o, v: o.mr.read(v), ("length", "MR read")),
    ("MR.write", lambda o, v: o.mr.write(v), ("data", "MR write")),
    ("MW(pd)", lambda o, v: MW(v), ("pd",)),
    ("MW(type)", lambda o, v: MW(o.pd, v), ("mw_type",)),
    ("PD", lambda o, v: PD(v), ("context",)),
    ("CompChannel", lambda o, v: CompChannel(v), ("context",)),
    ("CQ(context)", lambda o, v: CQ(v, 8), ("context",)),
    ("CQ(cqe)", lambda o, v: CQ(o.ctx, v), ("cqe",)),
    ("CQ(channel)", lambda o, v: CQ(o.ctx, 8, None, v), ("channel",)),
    ("CQ(comp_vector)", lambda o, v: CQ(o.ctx, 8, None, None, v), ("comp_vector",)),
    ("CQ.resize", lambda o, v: CQ(o.ctx, 8).resize(v), ("cqe", "resize")),
    ("CQ.ack_events", lambda o, v: o.cq.ack_events(v), ("num_events", "ack")),
    ("SRQ(pd)", lambda o, v: SRQ(v, SrqInitAttr()), ("pd",)),
    ("SRQ(init_attr)", lambda o, v: SRQ(o.pd, v), ("init_attr",)),
    *[(f"SrqAttr.{f}", (lambda f: lambda o, v: _srq_create(o, f, v))(f), (f,))
      for f in ("max_wr", "max_sge", "srq_limit")],
    ("SRQ.modify(attr)", lambda o, v: _srq(o).modify(v, 0), ("attr",)),
    ("SRQ.modify(mask)", lambda o, v: _srq(o).modify(SrqAttr(max_wr=16, srq_limit=4), v),
     ("attr_mask", "max_wr", "srq_limit")),
    ("SRQ.modify(max_wr)", lambda o, v: _srq(o).modify(SrqAttr(max_wr=v), 1), ("max_wr",)),
    ("SRQ.modify(srq_limit)", lambda o, v: _srq(o).modify(SrqAttr(srq_limit=v), 2),
     ("srq_limit",)),
    ("SRQ.post_recv", lambda o, v: _srq(o).post_recv(v), ("wr",)),
]


def _atomic(o, v) -> SendWR:
    wr = SendWR(wr_id=1, opcode=W.IBV_WR_ATOMIC_CMP_AND_SWP, sg=[SGE(o.mr.buf, 8, o.mr.lkey)])
    wr.set_wr_atomic(o.mr.rkey, o.mr.buf + 512, v, v)
    return wr


def _healthy_write(ctx) -> None:
    """A fresh pair on the same device completes an RDMA WRITE with the right bytes."""
    n = Net(ctx)
    a, _ = n.pair()
    data = os.urandom(64)
    n.mr.write(data, 64, 0)
    a.post_send(n.write_wr(99, 64, 0, 2048))
    drain(n.dev)
    assert n.completions() == {99: E.IBV_WC_SUCCESS}
    assert n.mr.read(64, 2048) == data


@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), target=st.sampled_from(TARGETS))
def test_anything_into_any_call_is_refused_by_name_or_works(dev, data, target):
    name, call, tokens = target
    with Context(name=DEV_NAME) as ctx:
        net = Net(ctx)
        a, b = net.pair()
        o = types.SimpleNamespace(ctx=ctx, net=net, pd=net.pd, cq=net.cq, mr=net.mr, a=a, b=b)
        wrong = [net.pd, net.cq, net.mr, ctx, a, CompChannel(ctx), SGE(), RecvWR(), SendWR(),
                 QPAttr(), AHAttr(), SrqAttr()]
        v = data.draw(_anything(wrong), label=name)
        fatal = dev.counters.qp_fatal
        sq, rq = len(a.sq), len(b.rq)
        try:
            call(o, v)
        except PyverbsRDMAError as e:
            msg = str(e).lower()
            assert any(t.lower() in msg for t in tokens), f"{name}: no field named in {e}"
            # bad_wr semantics: the WRs before the refused one are posted, nothing else
            posted = getattr(e, "bad_wr_index", 0)
            assert len(a.sq) + len(b.rq) == sq + rq + posted, "a refused WR changed a queue"
        drain(dev)  # whatever was accepted runs through the engines
        assert dev.counters.qp_fatal == fatal, "an accepted value made an engine fail"
        _healthy_write(ctx)
