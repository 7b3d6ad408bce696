"""softrdma.verbs_api on a real libibverbs device (kernel rxe in a lab guest).

Collected only where there is a device (tests/hw/conftest.py); CI runs it inside a lab
guest on rxe0 (tests/interop/test_backend_conformance.py). By hand, in a guest::

    SOFTRDMA_IBV_DEVICE=rxe0 .venv/bin/python -m pytest -q -p no:cacheprovider tests/hw

Every verb and opcode the soft backend has, through the same API: open and queries, PD,
MRs over bytearray/mmap/numpy, CQ with a completion channel (select, timeout, asyncio),
RC loopback (SEND/RECV with immediate, WRITE, WRITE with immediate, READ, both atomics,
inline, chains and bad_wr), MW type 1 (bind_mw) and type 2 (BIND_MW WR, LOCAL_INV,
SEND_WITH_INV), SRQ, UD with an AH, async events, errors with libibverbs' errnos, and the
pyverbs-compat layer running unchanged on the device.
"""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import select
import struct
import sys

import pytest

from softrdma.verbs_api import (
    AH, CQ, MR, MW, PD, QP, SGE, SRQ, AHAttr, CompChannel, Context, GlobalRoute,
    MWBind, MWBindInfo, PyverbsRDMAError, QPAttr, QPCap, QPInitAttr, RecvWR, SendWR, SrqAttr,
    SrqInitAttr, get_device_list,
)
from softrdma.verbs_api import enums as E


def _hw_name() -> str | None:
    want = os.environ.get("SOFTRDMA_IBV_DEVICE")
    if want:
        return want
    if os.environ.get("SOFTRDMA_BACKEND", "auto") == "soft":
        return None
    from softrdma.ibverbs import devices
    found = devices.list_devices()
    return found[0].name if found else None


DEV = _hw_name()  # not None: tests/hw/conftest.py collects this file only with a device

RW = (E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_REMOTE_READ
      | E.IBV_ACCESS_REMOTE_ATOMIC)


@pytest.fixture
def ctx():
    with Context(name=DEV) as c:
        yield c


def _gid_index(ctx) -> int:
    """The RoCEv2 entry holding an IPv4 address (rxe: index 1), else the last RoCEv2 one."""
    table = ctx.query_gid_table()
    v2 = [(i, g) for i, g, t in table if t == E.IBV_GID_TYPE_ROCE_V2] or \
        [(i, g) for i, g, _ in table]
    v4 = [i for i, g in v2 if g.raw[:12] == bytes(10) + b"\xff\xff"]
    return v4[0] if v4 else v2[-1][0]


class Pair:
    """Two connected RC (or UC) QPs on one device (loopback), with their CQs and MRs."""

    def __init__(self, ctx, qp_type=E.IBV_QPT_RC, srq=None, channel=None, pd=None):
        self.ctx = ctx
        self.pd = pd or PD(ctx)
        self.gidx = _gid_index(ctx)
        self.gid = ctx.query_gid(1, self.gidx)
        self.cq = CQ(ctx, 64, None, channel, 0)
        self.mr = [MR(self.pd, 4096, RW), MR(self.pd, 4096, RW)]
        cap = QPCap(max_send_wr=32, max_recv_wr=32, max_send_sge=2, max_recv_sge=2,
                    max_inline_data=64)
        self.qp = [QP(self.pd, QPInitAttr(qp_type=qp_type, scq=self.cq, rcq=self.cq,
                                          srq=srq, cap=cap, sq_sig_all=0))
                   for _ in range(2)]
        for a, b in ((0, 1), (1, 0)):
            attr = QPAttr(qp_access_flags=RW,
                          path_mtu=E.IBV_MTU_1024, dest_qp_num=self.qp[b].qp_num, rq_psn=0,
                          sq_psn=0, max_rd_atomic=4, max_dest_rd_atomic=4, min_rnr_timer=12,
                          timeout=14, retry_cnt=7, rnr_retry=7)
            attr.ah_attr = AHAttr(is_global=1, port_num=1, gr=GlobalRoute(
                dgid=self.gid, sgid_index=self.gidx, hop_limit=64))
            self.qp[a].to_rts(attr)

    def wait(self, n=1, timeout=10.0):
        import time
        out, end = [], time.monotonic() + timeout
        while len(out) < n:
            out += self.cq.poll(n - len(out))[1]
            if time.monotonic() > end:
                raise AssertionError(f"only {len(out)} of {n} completions: {out}")
        return out


def _sge(mr, off=0, length=64):
    return SGE(mr.buf + off, length, mr.lkey)


# -- open and queries -------------------------------------------------------------------------

def test_device_list_and_queries(ctx):
    assert DEV.encode() in [d.name for d in get_device_list()]
    assert isinstance(ctx, Context) and type(ctx).__name__ == "Context"
    a = ctx.query_device()
    assert a.max_qp > 0 and a.max_sge > 0 and a.phys_port_cnt >= 1 and a.node_guid
    p = ctx.query_port(1)
    assert p.state == E.IBV_PORT_ACTIVE and p.gid_tbl_len > 0
    assert p.link_layer == E.IBV_LINK_LAYER_ETHERNET
    i = _gid_index(ctx)
    assert ctx.query_gid(1, i) and ctx.query_gid_type(1, i) == E.IBV_GID_TYPE_ROCE_V2
    assert ctx.query_pkey(1, 0) == 0xFFFF
    with pytest.raises(PyverbsRDMAError) as e:
        ctx.query_port(7)
    assert e.value.error_code == errno.EINVAL


def test_mr_over_buffers_keeps_them_alive(ctx):
    pd = PD(ctx)
    ba = bytearray(b"x" * 100)
    mr = MR(pd, access=RW, buffer=ba)
    assert isinstance(mr, MR) and mr.length == 100 and mr.mem[0] == ord("x")
    with pytest.raises(BufferError):
        ba.extend(b"more")  # pinned while registered
    mm = mmap.mmap(-1, 8192)
    mr2 = MR(pd, access=RW, buffer=mm, address=0x10000)  # an iova of our choosing
    assert mr2.buf == 0x10000
    with pytest.raises(BufferError):
        mm.close()
    with pytest.raises(PyverbsRDMAError) as e:
        MR(pd, access=RW, buffer=b"read-only")
    assert e.value.error_code == errno.EFAULT
    try:
        import numpy
    except ImportError:
        numpy = None
    if numpy is not None:
        arr = numpy.zeros(16, dtype=numpy.uint64)
        mr3 = MR(pd, access=RW, buffer=arr)
        assert mr3.length == 128 and mr3.buf == arr.ctypes.data
        mr3.close()
    mr.close()
    ba.extend(b"ok now")  # deregistered: free to resize
    mr2.close()
    mm.close()
    with pytest.raises(PyverbsRDMAError) as e:  # remote write needs local write
        MR(pd, 16, E.IBV_ACCESS_REMOTE_WRITE)
    assert e.value.error_code == errno.EINVAL


def test_pd_in_use_is_ebusy_and_context_close_destroys_in_order():
    c = Context(name=DEV)
    pd = PD(c)
    MR(pd, 64, RW)
    with pytest.raises(PyverbsRDMAError) as e:
        pd.close()
    assert e.value.error_code == errno.EBUSY
    Pair(c)  # QPs, CQs, MRs left open
    c.close()
    assert pd.closed


# -- RC data path -------------------------------------------------------------------------

def test_send_recv_with_immediate(ctx):
    p = Pair(ctx)
    p.mr[1].write(b"\0" * 64, 64)
    p.qp[1].post_recv(RecvWR(wr_id=7, sg=[_sge(p.mr[1])]))
    p.mr[0].write(b"hello rxe", 9)
    p.qp[0].post_send(SendWR(wr_id=1, opcode=E.IBV_WR_SEND_WITH_IMM, imm_data=0x11223344,
                             sg=[_sge(p.mr[0], 0, 9)], send_flags=E.IBV_SEND_SIGNALED))
    wcs = sorted(p.wait(2), key=lambda w: w.wr_id)
    assert [w.status for w in wcs] == [0, 0], wcs
    send, recv = wcs
    assert send.opcode == E.IBV_WC_SEND
    assert recv.opcode == E.IBV_WC_RECV and recv.byte_len == 9 and recv.wr_id == 7
    assert recv.wc_flags & E.IBV_WC_WITH_IMM and recv.imm_data == 0x11223344
    assert recv.qp_num == p.qp[1].qp_num  # (rxe reports src_qp only for UD: 0 here)
    assert p.mr[1].read(9, 0) == b"hello rxe"


def test_write_read_atomics_inline(ctx):
    p = Pair(ctx)
    m0, m1 = p.mr
    m0.write(b"W" * 64, 64)
    wr = SendWR(wr_id=1, opcode=E.IBV_WR_RDMA_WRITE, sg=[_sge(m0)])
    wr.set_wr_rdma(m1.rkey, m1.buf + 128)
    p.qp[0].post_send(wr)
    rd = SendWR(wr_id=2, opcode=E.IBV_WR_RDMA_READ, sg=[_sge(m0, 256, 64)])
    rd.set_wr_rdma(m1.rkey, m1.buf + 128)
    p.qp[0].post_send(rd)
    m1.write(struct.pack("<Q", 5), 8, 512)
    cas = SendWR(wr_id=3, opcode=E.IBV_WR_ATOMIC_CMP_AND_SWP, sg=[_sge(m0, 1024, 8)])
    cas.set_wr_atomic(m1.rkey, m1.buf + 512, 5, 9)
    fa = SendWR(wr_id=4, opcode=E.IBV_WR_ATOMIC_FETCH_AND_ADD, sg=[_sge(m0, 1032, 8)])
    fa.set_wr_atomic(m1.rkey, m1.buf + 512, 100)
    cas.next_wr = fa
    p.qp[0].post_send(cas)
    m0.write(b"inline!", 7, 2048)
    inl = SendWR(wr_id=5, opcode=E.IBV_WR_RDMA_WRITE, sg=[_sge(m0, 2048, 7)],
                 send_flags=E.IBV_SEND_SIGNALED | E.IBV_SEND_INLINE)
    inl.set_wr_rdma(m1.rkey, m1.buf + 3000)
    p.qp[0].post_send(inl)
    wcs = sorted(p.wait(5), key=lambda w: w.wr_id)
    assert [(w.wr_id, w.status) for w in wcs] == [(i, 0) for i in range(1, 6)], wcs
    assert [w.opcode for w in wcs] == [E.IBV_WC_RDMA_WRITE, E.IBV_WC_RDMA_READ,
                                      E.IBV_WC_COMP_SWAP, E.IBV_WC_FETCH_ADD,
                                      E.IBV_WC_RDMA_WRITE]
    assert m1.read(64, 128) == b"W" * 64 and m0.read(64, 256) == b"W" * 64
    assert struct.unpack("<QQ", m0.read(16, 1024)) == (5, 9)
    assert struct.unpack("<Q", m1.read(8, 512)) == (109,)
    assert m1.read(7, 3000) == b"inline!"


def test_write_with_imm_and_iova_mrs(ctx):
    p = Pair(ctx)
    buf = mmap.mmap(-1, 4096)
    mr = MR(p.pd, access=RW, buffer=buf, address=0x7000_0000)  # iova != address
    p.qp[1].post_recv(RecvWR(wr_id=9))
    p.mr[0].write(b"via iova", 8)
    wr = SendWR(wr_id=1, opcode=E.IBV_WR_RDMA_WRITE_WITH_IMM, imm_data=0xA1B2C3D4,
                sg=[_sge(p.mr[0], 0, 8)])
    wr.set_wr_rdma(mr.rkey, 0x7000_0000 + 100)
    p.qp[0].post_send(wr)
    (w,) = p.wait(1)
    assert w.status == 0 and w.opcode == E.IBV_WC_RECV_RDMA_WITH_IMM and w.wr_id == 9
    assert w.imm_data == 0xA1B2C3D4 and bytes(buf[100:108]) == b"via iova"
    # inline from an iova MR: the backend hands the provider the real address
    mr.write(b"inl-iova", 8, 200)
    inl = SendWR(wr_id=2, opcode=E.IBV_WR_RDMA_WRITE, sg=[SGE(mr.buf + 200, 8, mr.lkey)],
                 send_flags=E.IBV_SEND_SIGNALED | E.IBV_SEND_INLINE)
    inl.set_wr_rdma(p.mr[1].rkey, p.mr[1].buf)
    p.qp[0].post_send(inl)
    (w,) = p.wait(1)
    assert w.status == 0 and p.mr[1].read(8, 0) == b"inl-iova"


def test_chains_and_bad_wr(ctx):
    p = Pair(ctx)
    wrs = [RecvWR(wr_id=i, sg=[_sge(p.mr[1], 64 * i)]) for i in range(3)]
    wrs[0].next_wr, wrs[1].next_wr = wrs[1], wrs[2]
    p.qp[1].post_recv(wrs[0])
    bad = SendWR()
    a = SendWR(wr_id=10, opcode=E.IBV_WR_SEND, sg=[_sge(p.mr[0])])
    b = SendWR(wr_id=11, opcode=E.IBV_WR_SEND, sg=[_sge(p.mr[0])])
    b.remote_addr = -1  # refused by the checks, naming the field
    c = SendWR(wr_id=12, opcode=E.IBV_WR_SEND, sg=[_sge(p.mr[0])])
    with pytest.raises(PyverbsRDMAError) as e:
        p.qp[0].post_send([a, b, c], bad)
    assert e.value.error_code == errno.EINVAL and e.value.bad_wr_index == 1
    assert "wr[1].remote_addr" in str(e.value) and bad.wr_id == 11
    # the device's own refusal: too many SGEs for the QP
    d = SendWR(wr_id=13, opcode=E.IBV_WR_SEND, sg=[_sge(p.mr[0], 64 * i, 8) for i in range(5)])
    with pytest.raises(PyverbsRDMAError) as e:
        p.qp[0].post_send([c, d])
    assert e.value.error_code == errno.EINVAL and e.value.bad_wr_index == 1
    ws = p.wait(4)  # a (before b) and c (before d), and the two receives they consume
    assert all(w.status == 0 for w in ws), ws
    assert sorted(w.wr_id for w in ws) == [0, 1, 10, 12]


def test_modify_errors_and_query(ctx):
    p = Pair(ctx)
    pd, cq = p.pd, p.cq
    qp = QP(pd, QPInitAttr(qp_type=E.IBV_QPT_RC, scq=cq, rcq=cq, cap=QPCap()))
    assert qp.state == E.IBV_QPS_RESET
    with pytest.raises(PyverbsRDMAError) as e:
        qp.modify(QPAttr(qp_state=E.IBV_QPS_RTS), E.IBV_QP_STATE)
    assert e.value.error_code == errno.EINVAL
    with pytest.raises(PyverbsRDMAError) as e:
        qp.modify(QPAttr(qp_state=E.IBV_QPS_INIT, port_num=1), E.IBV_QP_STATE | E.IBV_QP_PORT
                  | E.IBV_QP_PKEY_INDEX)  # RESET->INIT without access flags
    assert e.value.error_code == errno.EINVAL
    a, ia = p.qp[0].query(E.IBV_QP_STATE | E.IBV_QP_CAP | E.IBV_QP_AV | E.IBV_QP_DEST_QPN)
    assert a.qp_state == E.IBV_QPS_RTS and a.dest_qp_num == p.qp[1].qp_num
    assert a.ah_attr.gr.dgid == p.gid and ia.cap.max_send_wr >= 32
    p.qp[0].to_error()
    assert p.qp[0].state == E.IBV_QPS_ERR
    qp.close()


def test_mr_iova_must_share_the_page_offset(ctx):
    pd = PD(ctx)
    mm = mmap.mmap(-1, 8192)
    with pytest.raises(PyverbsRDMAError) as e:
        MR(pd, 100, RW, address=0x7000_0010, buffer=mm)
    assert e.value.error_code == errno.EINVAL and "offsets in a page" in str(e.value)
    MR(pd, 100, RW, address=0x7000_0000, buffer=mm).close()
    mm.close()


def test_mr_at_a_bad_address_is_efault(ctx):
    from softrdma.pyverbs_compat.mr import MR as CompatMR
    pd = PD(ctx)
    with pytest.raises(PyverbsRDMAError) as e:
        CompatMR(pd, 4096, E.IBV_ACCESS_LOCAL_WRITE, address=0x10)
    assert e.value.error_code == errno.EFAULT


# -- completion channel ----------------------------------------------------------------------

def test_completion_channel_select_timeout_asyncio(ctx):
    ch = CompChannel(ctx)
    p = Pair(ctx, channel=ch)
    with pytest.raises(PyverbsRDMAError) as e:
        ch.get_cq_event(p.cq, timeout=0.05)
    assert e.value.error_code == errno.ETIMEDOUT
    p.cq.req_notify()
    p.qp[1].post_recv(RecvWR(wr_id=1, sg=[_sge(p.mr[1])]))
    p.qp[0].post_send(SendWR(wr_id=2, sg=[_sge(p.mr[0], 0, 4)]))
    assert select.select([ch.fd], [], [], 5)[0] == [ch.fd]
    assert ch.get_cq_event(p.cq, timeout=5) is p.cq
    p.cq.ack_events(1)
    assert len(p.wait(2)) == 2

    async def one():
        p.cq.req_notify()
        p.qp[1].post_recv(RecvWR(wr_id=3, sg=[_sge(p.mr[1])]))
        p.qp[0].post_send(SendWR(wr_id=4, sg=[_sge(p.mr[0], 0, 4)]))
        return await asyncio.wait_for(ch.wait_async(), 5)

    assert asyncio.run(one()) is p.cq
    assert len(p.wait(2)) == 2
    # an event left unacknowledged: close() refuses (EBUSY), Context.close acks it for us
    p.cq.req_notify()
    p.qp[1].post_recv(RecvWR(wr_id=5, sg=[_sge(p.mr[1])]))
    p.qp[0].post_send(SendWR(wr_id=6, sg=[_sge(p.mr[0], 0, 4)]))
    ch.get_cq_event(p.cq, timeout=5)
    with pytest.raises(PyverbsRDMAError) as e:
        p.cq.close()
    assert e.value.error_code == errno.EBUSY


# -- memory windows --------------------------------------------------------------------------

def test_mw_type1_bind_and_write_through_it(ctx):
    p = Pair(ctx)
    mr = MR(p.pd, 4096, RW | E.IBV_ACCESS_MW_BIND)
    mw = MW(p.pd, E.IBV_MW_TYPE_1)
    old = mw.rkey
    p.qp[1].bind_mw(mw, MWBind(MWBindInfo(mr, mr.buf, 1024, E.IBV_ACCESS_REMOTE_WRITE),
                               E.IBV_SEND_SIGNALED, wr_id=77))
    (w,) = p.wait(1)
    assert w.status == 0 and w.opcode == E.IBV_WC_BIND_MW and w.wr_id == 77
    assert mw.rkey != old
    p.mr[0].write(b"through-mw", 10)
    wr = SendWR(wr_id=1, opcode=E.IBV_WR_RDMA_WRITE, sg=[_sge(p.mr[0], 0, 10)])
    wr.set_wr_rdma(mw.rkey, mr.buf + 8)
    wr.send_flags = E.IBV_SEND_SIGNALED
    p.qp[0].post_send(wr)
    (w,) = p.wait(1)
    assert w.status == 0 and mr.read(10, 8) == b"through-mw"
    mw.close()
    mr.close()


def test_mw_type2_bind_wr_local_inv_and_send_with_inv(ctx):
    p = Pair(ctx)
    mr = MR(p.pd, 4096, RW | E.IBV_ACCESS_MW_BIND)
    try:
        mw = MW(p.pd, E.IBV_MW_TYPE_2)
    except PyverbsRDMAError as e:
        pytest.skip(f"no type 2 windows: {e}")
    bind = SendWR(wr_id=1, opcode=E.IBV_WR_BIND_MW)
    bind.set_bind_wr(mw, MWBindInfo(mr, mr.buf, 4096, E.IBV_ACCESS_REMOTE_WRITE))
    p.qp[1].post_send(bind)
    (w,) = p.wait(1)
    assert w.status == 0 and w.opcode == E.IBV_WC_BIND_MW
    key = mw.rkey
    # the peer invalidates it with SEND_WITH_INV; the receiver sees the rkey, host order
    p.qp[1].post_recv(RecvWR(wr_id=2, sg=[_sge(p.mr[1])]))
    inv = SendWR(wr_id=3, opcode=E.IBV_WR_SEND_WITH_INV, sg=[_sge(p.mr[0], 0, 4)])
    inv.invalidate_rkey = key
    p.qp[0].post_send(inv)
    ws = sorted(p.wait(2), key=lambda w: w.wr_id)
    assert [w.status for w in ws] == [0, 0], ws
    assert ws[0].wc_flags & E.IBV_WC_WITH_INV and ws[0].invalidated_rkey == key
    # bind again (a new key), then LOCAL_INV on the owner's side
    bind.set_bind_wr(mw, MWBindInfo(mr, mr.buf, 4096, E.IBV_ACCESS_REMOTE_WRITE))
    p.qp[1].post_send(bind)
    assert p.wait(1)[0].status == 0
    li = SendWR(wr_id=4, opcode=E.IBV_WR_LOCAL_INV)
    li.invalidate_rkey = mw.rkey
    p.qp[1].post_send(li)
    (w,) = p.wait(1)
    assert w.status == 0 and w.opcode == E.IBV_WC_LOCAL_INV


# -- SRQ and UD -------------------------------------------------------------------------------

def test_srq_and_its_limit_event(ctx):
    pd = PD(ctx)
    srq = SRQ(pd, SrqInitAttr(SrqAttr(max_wr=16, max_sge=1)))
    assert srq.query().max_wr >= 16
    p = Pair(ctx, srq=srq, pd=pd)  # the receive buffers must be in the QP's PD
    mr = MR(pd, 256, RW)
    srq.post_recv([RecvWR(wr_id=i, sg=[SGE(mr.buf + 64 * i, 64, mr.lkey)]) for i in range(3)])
    srq.modify(SrqAttr(srq_limit=2), E.IBV_SRQ_LIMIT)
    assert srq.query().srq_limit == 2
    for i in range(2):
        p.mr[0].write(b"via-srq%d" % i, 8)
        p.qp[0].post_send(SendWR(wr_id=5 + i, sg=[_sge(p.mr[0], 0, 8)]))
        ws = [w for w in p.wait(2) if w.opcode == E.IBV_WC_RECV]
        assert ws[0].status == 0 and mr.read(8, 64 * ws[0].wr_id) == b"via-srq%d" % i
    # one receive left, below the limit of 2: the device raised SRQ_LIMIT_REACHED
    assert select.select([ctx.async_fd], [], [], 10)[0]
    ev = ctx.get_async_event(block=False)
    assert ev.event_type == E.IBV_EVENT_SRQ_LIMIT_REACHED and ev.element is srq
    assert srq.query().srq_limit == 0  # disarmed


def test_uc_send_and_write(ctx):
    p = Pair(ctx, qp_type=E.IBV_QPT_UC)
    p.qp[1].post_recv(RecvWR(wr_id=1, sg=[_sge(p.mr[1])]))
    p.mr[0].write(b"uc-send!", 8)
    p.qp[0].post_send(SendWR(wr_id=2, sg=[_sge(p.mr[0], 0, 8)]))
    wr = SendWR(wr_id=3, opcode=E.IBV_WR_RDMA_WRITE, sg=[_sge(p.mr[0], 0, 8)])
    wr.set_wr_rdma(p.mr[1].rkey, p.mr[1].buf + 512)
    p.qp[0].post_send(wr)
    ws = sorted(p.wait(3), key=lambda w: w.wr_id)
    assert [w.status for w in ws] == [0, 0, 0], ws
    assert p.mr[1].read(8, 0) == b"uc-send!" and p.mr[1].read(8, 512) == b"uc-send!"


def test_ud_with_ah(ctx):
    pd = PD(ctx)
    cq = CQ(ctx, 16)
    gidx = _gid_index(ctx)
    gid = ctx.query_gid(1, gidx)
    qps = [QP(pd, QPInitAttr(qp_type=E.IBV_QPT_UD, scq=cq, rcq=cq, cap=QPCap()),
              QPAttr(qkey=0x1234)) for _ in range(2)]
    assert all(q.state == E.IBV_QPS_RTS for q in qps)
    mr = MR(pd, 4096, RW)
    qps[1].post_recv(RecvWR(wr_id=1, sg=[SGE(mr.buf, 40 + 100, mr.lkey)]))
    ah = AH(pd, AHAttr(is_global=1, port_num=1, gr=GlobalRoute(dgid=gid, sgid_index=gidx,
                                                                hop_limit=64)))
    mr.write(b"ud-datagram", 11, 1000)
    wr = SendWR(wr_id=2, sg=[SGE(mr.buf + 1000, 11, mr.lkey)])
    wr.set_wr_ud(ah, qps[1].qp_num, 0x1234)
    qps[0].post_send(wr)
    import time
    ws, end = [], time.monotonic() + 10
    while len(ws) < 2 and time.monotonic() < end:
        ws += cq.poll(2)[1]
    ws.sort(key=lambda w: w.wr_id)
    assert [w.status for w in ws] == [0, 0], ws
    assert ws[0].src_qp == qps[0].qp_num and ws[0].byte_len == 40 + 11
    assert ws[0].wc_flags & E.IBV_WC_GRH and mr.read(11, 40) == b"ud-datagram"


def test_async_events_do_not_block(ctx):
    fd = ctx.async_fd
    assert isinstance(fd, int) and fd >= 0
    ev = ctx.get_async_event(block=False)  # none pending, or e.g. a port event
    assert ev is None or hasattr(ev, "event_type")


# -- the pyverbs-compat layer on the device --------------------------------------------------

def test_pyverbs_compat_runs_on_the_device():
    from softrdma.pyverbs_compat import cq as pcq, device as pdev, mr as pmr, pd as ppd
    from softrdma.pyverbs_compat import qp as pqp
    with pdev.Context(name=DEV) as c:
        pd = ppd.PD(c)
        # one class on both backends, holding the device's implementation
        assert [k.__name__ for k in type(pd).__mro__][:3] == ["PD", "CascadeClose", "PD"]
        assert type(pd.impl).__name__ == "HwPD" and not hasattr(pd, "_addr")
        mr = pmr.MR(pd, 64, E.IBV_ACCESS_LOCAL_WRITE)
        cq = pcq.CQ(c, 8)
        qp = pqp.QP(pd, pqp.QPInitAttr(qp_type=E.IBV_QPT_RC, scq=cq, rcq=cq,
                                      cap=pqp.QPCap(max_send_wr=4, max_recv_wr=4)))
        assert qp.qp_state == E.IBV_QPS_RESET
        pd.close()  # pyverbs: closes the QP and MR first
        assert qp.closed and mr.closed and not cq.closed


def test_immediate_data_matches_real_pyverbs_on_the_wire():
    """softrdma's imm_data (a host integer) and pyverbs' (raw __be32, htonl'd by programs)
    meet on rxe0: tests/programs/ibverbs_pyverbs_imm.py under the system python3."""
    import subprocess
    from pathlib import Path
    py = "/usr/bin/python3"
    if DEV != "rxe0" or subprocess.run([py, "-c", "import pyverbs"],
                                       capture_output=True).returncode:
        pytest.skip("needs rxe0 and the system python3 with pyverbs")
    prog = Path(__file__).parents[1] / "programs" / "ibverbs_pyverbs_imm.py"
    r = subprocess.run([py, str(prog)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("ok=True") == 2, r.stdout


if __name__ == "__main__":
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", __file__]))
