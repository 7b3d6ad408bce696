"""Conformance: the data path between two QPs of the device under test, in loopback.

Every expectation is the verbs/IBTA semantics or rxe's documented behaviour (facts A.10-A.12:
completion opcodes, byte_len, wc_flags, the UD GRH area), computed in the test from what it
sent.
"""

from __future__ import annotations

import struct

import pytest

from softrdma.verbs_api import (
    AH, MW, SGE, SRQ, AHAttr, GlobalRoute, MWBind, MWBindInfo, QPCap, RecvWR, SendWR, SrqAttr,
    SrqInitAttr,
)
from softrdma.verbs_api import enums as E

from .conftest import (
    GRH_LEN, LW, QKEY, RR, RW, pattern, poll, poll_none, qp_state, recv_wr, send_wr, wait_fd,
)

OK = E.IBV_WC_SUCCESS
RC, UC, UD = E.IBV_QPT_RC, E.IBV_QPT_UC, E.IBV_QPT_UD
CONNECTED = pytest.mark.parametrize("qpt", [RC, UC], ids=["RC", "UC"])
U64 = struct.Struct("=Q")  # atomics act on 64-bit words in the host's byte order


def one(cq, wr_id=None, status=OK, opcode=None):
    (wc,) = poll(cq, 1)
    assert wc.status == status, wc
    if wr_id is not None:
        assert wc.wr_id == wr_id, wc
    if opcode is not None:
        assert wc.opcode == opcode, wc
    return wc


@pytest.mark.parametrize("qpt", [RC, UC, UD], ids=["RC", "UC", "UD"])
def test_send_recv(res, qpt):
    scq, rcq = res.cq_(), res.cq_()
    a, b = res.qp(qpt, scq=scq, rcq=scq), res.qp(qpt, scq=rcq, rcq=rcq)
    if qpt == UD:
        res.ud_to_rts(a), res.ud_to_rts(b)
    else:
        res.connect(a, b.qp_num, rq_psn=1, sq_psn=2)
        res.connect(b, a.qp_num, rq_psn=2, sq_psn=1)
    mr = res.mr(8192)
    data = pattern(300)
    mr.write(data, 300, 0)
    off = GRH_LEN if qpt == UD else 0
    b.post_recv(recv_wr(mr, 4096, 1024, wr_id=11))
    wr = send_wr(mr, 0, 300, wr_id=22)
    if qpt == UD:
        wr.set_wr_ud(res.ah(), b.qp_num, QKEY)
    a.post_send(wr)
    s = one(scq, 22, opcode=E.IBV_WC_SEND)
    assert s.qp_num == a.qp_num
    r = one(rcq, 11, opcode=E.IBV_WC_RECV)
    assert r.qp_num == b.qp_num and r.byte_len == 300 + off
    assert not r.wc_flags & E.IBV_WC_WITH_IMM
    assert mr.read(300, 4096 + off) == data


@CONNECTED
def test_send_with_immediate(res, qpt):
    a, b = res.pair(qpt)
    mr = res.mr()
    mr.write(b"imm!", 4, 0)
    imm = 0x12345678
    b.post_recv(recv_wr(mr, 1024, 64, wr_id=1))
    a.post_send(send_wr(mr, 0, 4, wr_id=2, opcode=E.IBV_WR_SEND_WITH_IMM, imm_data=imm))
    wcs = poll(res.cq, 2)
    r = next(w for w in wcs if w.qp_num == b.qp_num)
    s = next(w for w in wcs if w.qp_num == a.qp_num)
    assert (s.status, s.opcode, s.wr_id) == (OK, E.IBV_WC_SEND, 2)
    assert (r.status, r.opcode, r.wr_id, r.byte_len) == (OK, E.IBV_WC_RECV, 1, 4)
    assert r.wc_flags & E.IBV_WC_WITH_IMM
    assert isinstance(r.imm_data, int) and r.imm_data == imm  # round trips as an integer
    assert mr.read(4, 1024) == b"imm!"


def test_ud_send_with_immediate_and_the_grh(res, differs):
    a, b = res.pair(UD)
    mr = res.mr()
    payload = pattern(101, 3)
    mr.write(payload, len(payload), 0)
    b.post_recv(recv_wr(mr, 1024, GRH_LEN + 512, wr_id=5))
    wr = send_wr(mr, 0, len(payload), wr_id=6, opcode=E.IBV_WR_SEND_WITH_IMM,
                 imm_data=0xCAFEF00D)
    wr.set_wr_ud(res.ah(), b.qp_num, QKEY)
    a.post_send(wr)
    wcs = poll(res.cq, 2)
    r = next(w for w in wcs if w.qp_num == b.qp_num)
    assert (r.status, r.opcode, r.wr_id) == (OK, E.IBV_WC_RECV, 5)
    assert r.byte_len == GRH_LEN + len(payload)  # the 40-byte GRH area counts
    assert r.src_qp == a.qp_num
    assert r.wc_flags & E.IBV_WC_GRH and r.wc_flags & E.IBV_WC_WITH_IMM
    assert r.imm_data == 0xCAFEF00D
    assert mr.read(len(payload), 1024 + GRH_LEN) == payload
    grh = mr.read(GRH_LEN, 1024)
    gid = res.gid.raw
    mapped = gid[:12] == bytes(10) + b"\xff\xff"
    if mapped or differs("non_ipv4_gid_network") == "ipv4":
        # RoCEv2 over IPv4: the IPv4 header sits in the last 20 bytes of the GRH area
        ip = grh[20:]
        assert ip[0] == 0x45 and ip[9] == 17  # IPv4, IHL 5; UDP
        pad = -len(payload) & 3
        # IP + UDP + BTH + DETH + ImmDt + payload + pad + ICRC
        assert struct.unpack("!H", ip[2:4])[0] == 20 + 8 + 12 + 8 + 4 + len(payload) + pad + 4
        assert ip[12:16] == ip[16:20]  # loopback: from and to our own address
        if mapped:
            assert ip[16:20] == gid[12:]
    else:
        assert grh[0] >> 4 == 6 and grh[6] == 17  # IPv6, next header UDP
        assert grh[8:24] == grh[24:40] == gid


def test_ud_grh_carries_the_ah_hop_limit_and_traffic_class(res):
    """The receiver's GRH area shows the IP header as it arrived: TTL 64 whatever the AH's
    hop limit (for RoCE the kernel's ib_resolve_eth_dmac replaces it with the route's, 64
    for IPv4; rxe 6.1 and 6.12 alike), TOS = the AH's traffic class (rxe's
    prepare_ipv4_hdr; softrdma sends it as IP_TOS and reads it back with IP_RECVTOS)."""
    a, b = res.pair(UD)
    mr = res.mr()
    hop_limit, tclass = 7, 0x20
    ah = res.keep(AH(res.pd, attr=AHAttr(is_global=1, port_num=1, gr=GlobalRoute(
        dgid=res.gid, sgid_index=res.gid_index, hop_limit=hop_limit, traffic_class=tclass))))
    b.post_recv(recv_wr(mr, 1024, GRH_LEN + 64, wr_id=1))
    wr = send_wr(mr, 0, 16, wr_id=2)
    wr.set_wr_ud(ah, b.qp_num, QKEY)
    a.post_send(wr)
    wcs = poll(res.cq, 2)
    assert all(w.status == OK for w in wcs)
    grh = mr.read(GRH_LEN, 1024)
    if grh[20] == 0x45:  # IPv4 in the last 20 bytes
        got = (grh[20 + 8], grh[20 + 1])
    else:  # IPv6: hop limit, traffic class across the first two bytes
        got = (grh[7], ((grh[0] & 0xF) << 4) | (grh[1] >> 4))
    assert got == (64, tclass)


@CONNECTED
def test_rdma_write_and_write_with_immediate(res, qpt):
    a, b = res.pair(qpt)
    src, dst = res.mr(8192), res.mr(8192)
    data = pattern(1000, 5)
    src.write(data, 1000, 0)
    wr = send_wr(src, 0, 1000, wr_id=1, opcode=E.IBV_WR_RDMA_WRITE)
    wr.set_wr_rdma(dst.rkey, dst.buf + 100)
    a.post_send(wr)
    one(res.cq, 1, opcode=E.IBV_WC_RDMA_WRITE)
    assert dst.read(1000, 100) == data
    assert dst.read(100, 0) == bytes(100) and dst.read(8, 1100) == bytes(8)
    poll_none(res.cq, 0.05)  # a plain WRITE consumes no receive and completes nothing at b
    # WRITE with immediate: consumes a receive; byte_len is the write's length
    b.post_recv(RecvWR(wr_id=7, sg=[SGE(dst.buf + 4096, 16, dst.lkey)]))
    wr = send_wr(src, 0, 600, wr_id=2, opcode=E.IBV_WR_RDMA_WRITE_WITH_IMM, imm_data=0xABCD)
    wr.set_wr_rdma(dst.rkey, dst.buf + 2048)
    a.post_send(wr)
    wcs = poll(res.cq, 2)
    s = next(w for w in wcs if w.qp_num == a.qp_num)
    r = next(w for w in wcs if w.qp_num == b.qp_num)
    assert (s.status, s.opcode, s.wr_id) == (OK, E.IBV_WC_RDMA_WRITE, 2)
    assert (r.status, r.opcode, r.wr_id) == (OK, E.IBV_WC_RECV_RDMA_WITH_IMM, 7)
    assert r.byte_len == 600 and r.wc_flags & E.IBV_WC_WITH_IMM and r.imm_data == 0xABCD
    assert dst.read(600, 2048) == data[:600]
    assert dst.read(16, 4096) == bytes(16)  # the receive buffer is not written


def test_rdma_read(res):
    a, b = res.pair(RC)
    local, remote = res.mr(8192), res.mr(8192, LW | RR)
    data = pattern(3000, 7)
    remote.write(data, 3000, 1000)
    wr = send_wr(local, 10, 3000, wr_id=3, opcode=E.IBV_WR_RDMA_READ)
    wr.set_wr_rdma(remote.rkey, remote.buf + 1000)
    a.post_send(wr)
    wc = one(res.cq, 3, opcode=E.IBV_WC_RDMA_READ)
    assert wc.byte_len == 3000
    assert local.read(3000, 10) == data
    assert local.read(10, 0) == bytes(10)


def test_atomics(res):
    a, b = res.pair(RC)
    local, remote = res.mr(4096), res.mr(4096)
    remote.write(U64.pack(1000), 8, 64)
    # FETCH_AND_ADD: the original comes back, the remote word grows
    wr = send_wr(local, 0, 8, wr_id=1, opcode=E.IBV_WR_ATOMIC_FETCH_AND_ADD)
    wr.set_wr_atomic(remote.rkey, remote.buf + 64, 234)
    a.post_send(wr)
    wc = one(res.cq, 1, opcode=E.IBV_WC_FETCH_ADD)
    assert wc.byte_len == 8
    assert U64.unpack(local.read(8, 0))[0] == 1000
    assert U64.unpack(remote.read(8, 64))[0] == 1234
    # COMPARE_AND_SWAP that matches: swapped, original returned
    wr = send_wr(local, 8, 8, wr_id=2, opcode=E.IBV_WR_ATOMIC_CMP_AND_SWP)
    wr.set_wr_atomic(remote.rkey, remote.buf + 64, 1234, 0xFEEDFACE12345678)
    a.post_send(wr)
    one(res.cq, 2, opcode=E.IBV_WC_COMP_SWAP)
    assert U64.unpack(local.read(8, 8))[0] == 1234
    assert U64.unpack(remote.read(8, 64))[0] == 0xFEEDFACE12345678
    # COMPARE_AND_SWAP that does not match: unchanged, the current value returned
    wr = send_wr(local, 16, 8, wr_id=3, opcode=E.IBV_WR_ATOMIC_CMP_AND_SWP)
    wr.set_wr_atomic(remote.rkey, remote.buf + 64, 1, 2)
    a.post_send(wr)
    one(res.cq, 3, opcode=E.IBV_WC_COMP_SWAP)
    assert U64.unpack(local.read(8, 16))[0] == 0xFEEDFACE12345678
    assert U64.unpack(remote.read(8, 64))[0] == 0xFEEDFACE12345678
    # FETCH_AND_ADD wraps modulo 2^64
    wr = send_wr(local, 24, 8, wr_id=4, opcode=E.IBV_WR_ATOMIC_FETCH_AND_ADD)
    wr.set_wr_atomic(remote.rkey, remote.buf + 64, (1 << 64) - 0xFEEDFACE12345678 + 5)
    a.post_send(wr)
    one(res.cq, 4, opcode=E.IBV_WC_FETCH_ADD)
    assert U64.unpack(remote.read(8, 64))[0] == 5


@pytest.mark.parametrize("qpt", [RC, UC, UD], ids=["RC", "UC", "UD"])
def test_inline_send_copies_at_post(res, qpt):
    cap = QPCap(max_send_wr=4, max_recv_wr=4, max_send_sge=1, max_recv_sge=1,
                max_inline_data=64)
    a, b = res.pair(qpt, cap)
    assert a.query(E.IBV_QP_CAP)[0].cap.max_inline_data >= 64
    mr = res.mr()
    data = pattern(60, 9)
    mr.write(data, 60, 0)
    off = GRH_LEN if qpt == UD else 0
    b.post_recv(recv_wr(mr, 2048, 512, wr_id=1))
    wr = send_wr(mr, 0, 60, wr_id=2, flags=E.IBV_SEND_SIGNALED | E.IBV_SEND_INLINE)
    if qpt == UD:
        wr.set_wr_ud(res.ah(), b.qp_num, QKEY)
    a.post_send(wr)
    mr.write(b"\x00" * 60, 60, 0)  # inline data was copied when posted
    wcs = poll(res.cq, 2)
    assert sorted((w.wr_id, w.status) for w in wcs) == [(1, OK), (2, OK)]
    assert mr.read(60, 2048 + off) == data


@CONNECTED
def test_multi_sge_gather_and_scatter(res, qpt):
    cap = QPCap(max_send_wr=4, max_recv_wr=4, max_send_sge=3, max_recv_sge=3)
    a, b = res.pair(qpt, cap)
    m1, m2, dst = res.mr(), res.mr(), res.mr(8192)
    p1, p2, p3 = pattern(100, 1), pattern(250, 2), pattern(77, 3)
    m1.write(p1, 100, 0), m1.write(p3, 77, 3000), m2.write(p2, 250, 500)
    b.post_recv(RecvWR(wr_id=1, sg=[SGE(dst.buf, 200, dst.lkey),
                                    SGE(dst.buf + 4096, 300, dst.lkey)]))
    a.post_send(SendWR(wr_id=2, sg=[SGE(m1.buf, 100, m1.lkey), SGE(m2.buf + 500, 250, m2.lkey),
                                    SGE(m1.buf + 3000, 77, m1.lkey)]))
    wcs = poll(res.cq, 2)
    r = next(w for w in wcs if w.qp_num == b.qp_num)
    assert (r.status, r.byte_len) == (OK, 427)
    whole = p1 + p2 + p3
    assert dst.read(200, 0) + dst.read(227, 4096) == whole
    assert dst.read(73, 4096 + 227) == bytes(73)


@CONNECTED
def test_messages_larger_than_the_mtu(res, qpt, mtu_bytes):
    a, b = res.pair(qpt)
    n = 3 * mtu_bytes + 123  # FIRST, MIDDLE, MIDDLE, LAST
    src, dst = res.mr(n + 4096), res.mr(2 * n + 8192)
    data = pattern(n, 11)
    src.write(data, n, 0)
    b.post_recv(recv_wr(dst, 0, n, wr_id=1))
    a.post_send(send_wr(src, 0, n, wr_id=2))
    wcs = poll(res.cq, 2)
    r = next(w for w in wcs if w.qp_num == b.qp_num)
    assert all(w.status == OK for w in wcs) and r.byte_len == n
    assert dst.read(n, 0) == data
    wr = send_wr(src, 0, n, wr_id=3, opcode=E.IBV_WR_RDMA_WRITE)
    wr.set_wr_rdma(dst.rkey, dst.buf + n + 4096)
    a.post_send(wr)
    one(res.cq, 3)
    assert dst.read(n, n + 4096) == data
    if qpt == RC:  # a multi-packet READ response
        wr = send_wr(src, 0, n, wr_id=4, opcode=E.IBV_WR_RDMA_READ)
        src.write(bytes(n), n, 0)
        wr.set_wr_rdma(dst.rkey, dst.buf)
        a.post_send(wr)
        assert one(res.cq, 4).byte_len == n
        assert src.read(n, 0) == data


def test_srq_receives(res):
    srq = res.keep(SRQ(res.pd, SrqInitAttr(SrqAttr(max_wr=8, max_sge=1))))
    rcq = res.cq_()
    cap = QPCap(max_send_wr=4, max_recv_wr=1)
    a1, a2 = res.qp(RC, cap), res.qp(RC, cap)
    b1, b2 = res.qp(RC, cap, rcq=rcq, srq=srq), res.qp(RC, cap, rcq=rcq, srq=srq)
    for x, y in ((a1, b1), (a2, b2)):
        res.connect(x, y.qp_num, rq_psn=5, sq_psn=9)
        res.connect(y, x.qp_num, rq_psn=9, sq_psn=5)
    mr = res.mr(8192)
    for i in range(3):
        srq.post_recv(recv_wr(mr, 4096 + 256 * i, 256, wr_id=100 + i))
    mr.write(b"from-a1", 7, 0), mr.write(b"from-a2!", 8, 64)
    a1.post_send(send_wr(mr, 0, 7, wr_id=1))
    poll(res.cq, 1)
    a2.post_send(send_wr(mr, 64, 8, wr_id=2))
    poll(res.cq, 1)
    w1, w2 = poll(rcq, 2)
    # the SRQ hands out its receives in order, to whichever QP a message arrives on
    assert (w1.wr_id, w1.qp_num, w1.byte_len, w1.status) == (100, b1.qp_num, 7, OK)
    assert (w2.wr_id, w2.qp_num, w2.byte_len, w2.status) == (101, b2.qp_num, 8, OK)
    assert mr.read(7, 4096) == b"from-a1" and mr.read(8, 4096 + 256) == b"from-a2!"


def test_completion_channel(res):
    ch = res.channel()
    rcq = res.cq_(16, ch)
    a, b = res.qp(RC), res.qp(RC, rcq=rcq)
    res.connect(a, b.qp_num, rq_psn=3, sq_psn=4)
    res.connect(b, a.qp_num, rq_psn=4, sq_psn=3)
    mr = res.mr()
    rcq.req_notify()
    b.post_recv(recv_wr(mr, 0, 64, wr_id=1))
    a.post_send(send_wr(mr, 100, 8, wr_id=2))
    assert wait_fd(ch.fd), "no completion event"
    assert ch.get_cq_event(rcq) is rcq
    rcq.ack_events(1)
    one(rcq, 1, opcode=E.IBV_WC_RECV)
    one(res.cq, 2)
    # re-armed: the next completion makes the next event
    rcq.req_notify()
    b.post_recv(recv_wr(mr, 0, 64, wr_id=3))
    a.post_send(send_wr(mr, 100, 8, wr_id=4))
    assert wait_fd(ch.fd), "no completion event after re-arming"
    ch.get_cq_event(rcq)
    rcq.ack_events(1)
    one(rcq, 3)
    one(res.cq, 4)


def test_unsignaled_sends_complete_nothing_unless_sq_sig_all(res):
    a, b = res.pair(RC)
    mr = res.mr()
    for i in range(2):
        b.post_recv(recv_wr(mr, 1024, 64, wr_id=10 + i))
    a.post_send(send_wr(mr, 0, 8, wr_id=1, flags=0))
    a.post_send(send_wr(mr, 0, 8, wr_id=2))
    wcs = poll(res.cq, 3)
    assert sorted(w.wr_id for w in wcs) == [2, 10, 11]  # wr 1: no completion
    poll_none(res.cq, 0.05)


def test_mw_type1_bind_and_remote_read_through_it(res, differs):
    a, b = res.pair(RC)
    local = res.mr()
    target = res.mr(8192, LW | RR | E.IBV_ACCESS_MW_BIND)
    target.write(pattern(512, 4), 512, 1024)
    mw = res.keep(MW(res.pd, E.IBV_MW_TYPE_1))
    b.bind_mw(mw, MWBind(MWBindInfo(target, target.buf + 1024, 512, RR),
                         E.IBV_SEND_SIGNALED, 77))
    one(res.cq, 77, opcode=E.IBV_WC_BIND_MW)
    wr = send_wr(local, 0, 512, wr_id=5, opcode=E.IBV_WR_RDMA_READ)
    wr.set_wr_rdma(mw.rkey, target.buf + 1024)
    a.post_send(wr)
    one(res.cq, 5)
    assert local.read(512, 0) == pattern(512, 4)
    # one byte outside the window: a remote access error, the requester goes to ERR
    wr = send_wr(local, 0, 16, wr_id=6, opcode=E.IBV_WR_RDMA_READ)
    wr.set_wr_rdma(mw.rkey, target.buf + 1024 + 512 - 8)
    a.post_send(wr)
    want = getattr(E, differs("mw_window_bounds"))
    one(res.cq, 6, status=want)
    assert qp_state(a) == (E.IBV_QPS_ERR if want != OK else E.IBV_QPS_RTS)


def _bind_type2(res, b, target, access=RR | RW):
    mw = res.keep(MW(res.pd, E.IBV_MW_TYPE_2))
    bind = SendWR(wr_id=50, opcode=E.IBV_WR_BIND_MW, send_flags=E.IBV_SEND_SIGNALED)
    bind.set_bind_wr(mw, MWBindInfo(target, target.buf, 4096, access))
    b.post_send(bind)
    one(res.cq, 50, opcode=E.IBV_WC_BIND_MW)
    return mw, bind.bind_rkey


def test_mw_type2_bind_and_local_invalidate(res):
    a, b = res.pair(RC)
    local = res.mr()
    target = res.mr(4096, LW | RR | RW | E.IBV_ACCESS_MW_BIND)
    mw, rkey = _bind_type2(res, b, target)
    local.write(b"through-the-window", 18, 0)
    wr = send_wr(local, 0, 18, wr_id=1, opcode=E.IBV_WR_RDMA_WRITE)
    wr.set_wr_rdma(rkey, target.buf + 100)
    a.post_send(wr)
    one(res.cq, 1)
    assert target.read(18, 100) == b"through-the-window"
    inv = SendWR(wr_id=2, opcode=E.IBV_WR_LOCAL_INV, send_flags=E.IBV_SEND_SIGNALED)
    inv.invalidate_rkey = rkey
    b.post_send(inv)
    one(res.cq, 2, opcode=E.IBV_WC_LOCAL_INV)
    wr = send_wr(local, 0, 8, wr_id=3, opcode=E.IBV_WR_RDMA_WRITE)
    wr.set_wr_rdma(rkey, target.buf + 100)
    a.post_send(wr)
    one(res.cq, 3, status=E.IBV_WC_REM_ACCESS_ERR)


def test_send_with_invalidate(res):
    a, b = res.pair(RC)
    mr = res.mr()
    target = res.mr(4096, LW | RR | RW | E.IBV_ACCESS_MW_BIND)
    mw, rkey = _bind_type2(res, b, target, RR)
    b.post_recv(recv_wr(mr, 2048, 64, wr_id=1))
    mr.write(b"bye", 3, 0)
    inv = send_wr(mr, 0, 3, wr_id=2, opcode=E.IBV_WR_SEND_WITH_INV)
    inv.invalidate_rkey = rkey
    a.post_send(inv)
    wcs = poll(res.cq, 2)
    s = next(w for w in wcs if w.qp_num == a.qp_num)
    r = next(w for w in wcs if w.qp_num == b.qp_num)
    assert (s.status, s.opcode) == (OK, E.IBV_WC_SEND)
    assert (r.status, r.opcode, r.byte_len) == (OK, E.IBV_WC_RECV, 3)
    assert r.wc_flags & E.IBV_WC_WITH_INV and r.invalidated_rkey == rkey
    assert mr.read(3, 2048) == b"bye"
    wr = send_wr(mr, 0, 8, wr_id=3, opcode=E.IBV_WR_RDMA_READ)
    wr.set_wr_rdma(rkey, target.buf)
    a.post_send(wr)
    one(res.cq, 3, status=E.IBV_WC_REM_ACCESS_ERR)  # the window is gone


def test_sq_sig_all_completes_unsignaled_wrs(res):
    a, b = res.qp(RC, sq_sig_all=1), res.qp(RC)
    res.connect(a, b.qp_num, rq_psn=1, sq_psn=2)
    res.connect(b, a.qp_num, rq_psn=2, sq_psn=1)
    mr = res.mr()
    b.post_recv(recv_wr(mr, 1024, 64, wr_id=10))
    a.post_send(send_wr(mr, 0, 8, wr_id=1, flags=0))
    wcs = poll(res.cq, 2)
    assert sorted((w.wr_id, w.status) for w in wcs) == [(1, OK), (10, OK)]


@CONNECTED
def test_zero_length_send_and_write(res, qpt):
    a, b = res.pair(qpt)
    mr = res.mr()
    b.post_recv(recv_wr(mr, 0, 64, wr_id=1))
    a.post_send(SendWR(wr_id=2))  # no SGE: a zero-length message
    wcs = poll(res.cq, 2)
    r = next(w for w in wcs if w.qp_num == b.qp_num)
    assert all(w.status == OK for w in wcs) and r.byte_len == 0
    # a zero-length WRITE checks no rkey (C9-88)
    wr = SendWR(wr_id=3, opcode=E.IBV_WR_RDMA_WRITE)
    wr.set_wr_rdma(0, 0)
    a.post_send(wr)
    one(res.cq, 3, opcode=E.IBV_WC_RDMA_WRITE)


def test_reads_and_atomics_queue_behind_max_rd_atomic(res):
    """max_rd_atomic 1: one READ/atomic in flight at a time; many posted complete, in order,
    each with its own data."""
    a, b = res.pair(RC, QPCap(max_send_wr=8, max_recv_wr=1), rd_atomic=1)
    local, remote = res.mr(8192), res.mr(8192)
    for i in range(4):
        remote.write(bytes([0x40 + i]) * 100, 100, 1000 * i)
    for i in range(4):
        wr = send_wr(local, 1000 * i, 100, wr_id=i, opcode=E.IBV_WR_RDMA_READ)
        wr.set_wr_rdma(remote.rkey, remote.buf + 1000 * i)
        a.post_send(wr)
    wr = send_wr(local, 7000, 8, wr_id=4, opcode=E.IBV_WR_ATOMIC_FETCH_AND_ADD)
    wr.set_wr_atomic(remote.rkey, remote.buf + 6000, 1)
    a.post_send(wr)
    wcs = poll(res.cq, 5)
    assert [(w.wr_id, w.status) for w in wcs] == [(i, OK) for i in range(5)]
    for i in range(4):
        assert local.read(100, 1000 * i) == bytes([0x40 + i]) * 100
    assert U64.unpack(remote.read(8, 6000))[0] == 1


@CONNECTED
def test_psn_wraps_at_2_24(res, qpt, mtu_bytes):
    """Start two PSNs before the 24-bit wrap: a 4-packet message and the next one cross it."""
    a, b = res.qp(qpt), res.qp(qpt)
    res.connect(a, b.qp_num, rq_psn=0xFFFFFE, sq_psn=0xFFFFFE)
    res.connect(b, a.qp_num, rq_psn=0xFFFFFE, sq_psn=0xFFFFFE)
    n = 3 * mtu_bytes + 1
    src, dst = res.mr(n), res.mr(2 * n)
    data = pattern(n, 13)
    src.write(data, n, 0)
    for i in range(2):
        b.post_recv(recv_wr(dst, i * n, n, wr_id=10 + i))
        a.post_send(send_wr(src, 0, n, wr_id=i))
    wcs = poll(res.cq, 4)
    assert sorted((w.wr_id, w.status) for w in wcs) == [(0, OK), (1, OK), (10, OK), (11, OK)]
    assert dst.read(n, 0) == data and dst.read(n, n) == data
    assert a.query(E.IBV_QP_STATE)[0].qp_state == E.IBV_QPS_RTS


def test_ud_message_over_the_mtu_is_not_delivered(res, port):
    """rxe (C10-93.1.1): a UD message larger than the port MTU is not sent, yet its send
    completes successfully; the receiver gets nothing and the next message arrives."""
    a, b = res.pair(UD)
    mtu = 128 << int(port.active_mtu)
    mr = res.mr(2 * mtu + 4096)
    b.post_recv(recv_wr(mr, mtu + 1024, mtu + GRH_LEN, wr_id=1))
    ah = res.ah()
    wr = send_wr(mr, 0, mtu + 1, wr_id=2)
    wr.set_wr_ud(ah, b.qp_num, QKEY)
    a.post_send(wr)
    assert [(w.wr_id, w.status) for w in poll(res.cq, 1)] == [(2, OK)]
    poll_none(res.cq, 0.1)
    wr = send_wr(mr, 0, mtu, wr_id=3)
    wr.set_wr_ud(ah, b.qp_num, QKEY)
    a.post_send(wr)
    wcs = poll(res.cq, 2)
    r = next(w for w in wcs if w.qp_num == b.qp_num)
    assert (r.wr_id, r.status, r.byte_len) == (1, OK, mtu + GRH_LEN)


def test_ud_wrong_qkey_is_dropped(res):
    a, b = res.pair(UD)
    mr = res.mr()
    b.post_recv(recv_wr(mr, 1024, 512, wr_id=1))
    ah = res.ah()
    wr = send_wr(mr, 0, 8, wr_id=2)
    wr.set_wr_ud(ah, b.qp_num, QKEY ^ 0x1)
    a.post_send(wr)
    assert [(w.wr_id, w.status) for w in poll(res.cq, 1)] == [(2, OK)]
    poll_none(res.cq, 0.1)  # the receiver's Q_Key check drops it
    wr.set_wr_ud(ah, b.qp_num, QKEY)
    wr.wr_id = 3
    a.post_send(wr)
    wcs = poll(res.cq, 2)
    assert sorted((w.wr_id, w.status) for w in wcs) == [(1, OK), (3, OK)]
