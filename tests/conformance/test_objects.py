"""Conformance: the verbs objects (device, port, GIDs, PD, MR, MW, CQ, CompChannel, SRQ, AH,
QP creation) as libibverbs on kernel rxe presents them.

Expected values come from the verbs specification and rxe's sources (the facts in
../shared/reference/rxe-and-pyverbs-facts.md A.6-A.8; the kernel's ib_check_mr_access and
rdma_check_ah_attr), or are derived from the device's own reported limits, never from the
soft implementation.
"""

from __future__ import annotations

import errno
import ipaddress
import mmap

import pytest

from softrdma.verbs_api import (
    AH, CQ, MR, MW, PD, QP, SRQ, AHAttr, GlobalRoute, QPAttr, QPCap, QPInitAttr, RecvWR,
    SrqAttr, SrqInitAttr,
)
from softrdma.verbs_api import enums as E

from .conftest import (DIFFERENCES, LW, RA, RR, RW, M, device_kind, expectation, poll,
                       raises_errno, rxe_series)


def ring(n: int) -> int:
    """rxe's queues are rings of roundup_pow_of_two(n + 1) slots, one kept empty."""
    slots = 1
    while slots < n + 1:
        slots *= 2
    return slots - 1


# -- device, port, GIDs ---------------------------------------------------------------------

def test_query_device(ctx):
    a = ctx.query_device()
    assert a.phys_port_cnt == 1
    assert a.max_qp_wr >= 1 and a.max_sge >= 1 and a.max_cqe >= 1
    assert a.max_qp_rd_atom >= 1 and a.max_qp_init_rd_atom >= 1
    assert a.atomic_caps != E.IBV_ATOMIC_NONE
    # RoCE: the node GUID is the interface ID of the default (index 0) GID
    assert a.node_guid.to_bytes(8, "big") == ctx.query_gid(1, 0).raw[8:]


def test_query_port(ctx):
    p = ctx.query_port(1)
    assert p.state == E.IBV_PORT_ACTIVE
    assert p.link_layer == E.IBV_LINK_LAYER_ETHERNET
    assert E.IBV_MTU_256 <= p.active_mtu <= p.max_mtu <= E.IBV_MTU_4096
    assert p.gid_tbl_len >= 2 and p.pkey_tbl_len >= 1
    raises_errno(errno.EINVAL, ctx.query_port, 2)  # one port


def test_gid_table(ctx, gid_index):
    g0 = ctx.query_gid(1, 0)
    assert g0.raw[:8] == bytes.fromhex("fe80000000000000")  # link-local, EUI-64 below
    g = ctx.query_gid(1, gid_index)
    assert g, "the GID index under test is empty"
    if gid_index != 0:
        # the index under test holds the IPv4-mapped RoCEv2 GID ::ffff:a.b.c.d
        assert g.raw[:12] == bytes(10) + b"\xff\xff"
        ipaddress.IPv4Address(g.raw[12:])
    assert ctx.query_gid_type(1, gid_index) == E.IBV_GID_TYPE_ROCE_V2
    raises_errno(errno.EINVAL, ctx.query_gid, 1, ctx.query_port(1).gid_tbl_len)


def test_query_pkey(ctx):
    assert ctx.query_pkey(1, 0) == 0xFFFF  # the default full-membership P_Key


# -- PD, MR -----------------------------------------------------------------------------------

def test_pd_alloc_and_busy_close(res):
    pd = PD(res.ctx)
    mr = MR(pd, 64, LW)
    raises_errno(errno.EBUSY, pd.close)  # ibv_dealloc_pd with an MR: EBUSY
    mr.close()
    pd.close()


def test_mr_allocated(res):
    mr = res.mr(4096, LW | RW | RR)
    other = res.mr(4096, LW)
    assert mr.length == 4096 and mr.lkey != other.lkey and mr.rkey != other.rkey
    mr.write(b"conformance", 11, 100)
    assert mr.read(11, 100) == b"conformance"
    assert mr.read(4, 0) == bytes(4)  # zeroed


def test_mr_over_bytearray(res):
    buf = bytearray(b"\xaa" * 4096)
    mr = res.mr_over(buf, LW | RW)
    assert mr.length == 4096
    mr.write(b"xyz", 3, 10)
    assert buf[10:13] == b"xyz"  # the MR is the buffer, not a copy
    buf[0:2] = b"QQ"
    assert mr.read(2, 0) == b"QQ"


def test_mr_over_mmap(res):
    m = mmap.mmap(-1, 8192)
    mr = res.mr_over(m, LW | RW | RR)
    assert mr.length == 8192
    mr.write(b"mapped", 6, 4096)
    assert m[4096:4102] == b"mapped"
    mr.close()


@pytest.mark.parametrize("access", [RW, RA, RW | RR, RA | RR])
def test_mr_remote_write_or_atomic_needs_local_write(res, access):
    # ib_check_mr_access: REMOTE_WRITE or REMOTE_ATOMIC without LOCAL_WRITE is EINVAL
    raises_errno(errno.EINVAL, MR, res.pd, 64, access)


@pytest.mark.parametrize("access", [0, LW, RR, LW | RW, LW | RA, LW | RW | RR | RA])
def test_mr_access_combinations(res, access):
    assert res.mr(64, access).length == 64


# -- MW -------------------------------------------------------------------------------------

def test_mw_alloc_both_types(res):
    mw1 = res.keep(MW(res.pd, E.IBV_MW_TYPE_1))
    mw2 = res.keep(MW(res.pd, E.IBV_MW_TYPE_2))
    assert mw1.rkey != mw2.rkey
    raises_errno(errno.EBUSY, res.pd.close)  # the PD has windows


# -- CQ, CompChannel ------------------------------------------------------------------------

@pytest.mark.parametrize("cqe", [1, 15, 16, 100])
def test_cq_size_is_rounded_up_as_rxe_rings(res, cqe):
    cq = res.cq_(cqe)
    assert cq.cqe == ring(cqe) >= cqe


def test_cq_size_limits(res):
    limit = res.ctx.query_device().max_cqe
    raises_errno(errno.EINVAL, CQ, res.ctx, limit + 1, None, None, 0)
    raises_errno(errno.EINVAL, CQ, res.ctx, 0, None, None, 0)


def test_cq_resize(res):
    cq = res.cq_(10)
    assert cq.cqe == 15
    cq.resize(100)
    assert cq.cqe == 127
    cq.resize(20)
    assert cq.cqe == 31


def test_comp_channel_and_cq_on_it(res):
    ch = res.channel()
    assert isinstance(ch.fd, int) and ch.fd >= 0
    cq = res.cq_(8, ch)
    cq.req_notify()
    raises_errno(errno.EBUSY, ch.close)  # a CQ is attached
    cq.close()


# -- SRQ ------------------------------------------------------------------------------------

def test_srq_create_query_and_full(res):
    srq = res.keep(SRQ(res.pd, SrqInitAttr(SrqAttr(max_wr=8, max_sge=1))))
    got = srq.query()
    assert got.max_wr == ring(8) and got.max_sge >= 1
    for i in range(got.max_wr):
        srq.post_recv(RecvWR(wr_id=i))
    raises_errno(errno.ENOMEM, srq.post_recv, RecvWR(wr_id=99))
    limit = res.ctx.query_device().max_srq_wr
    raises_errno(errno.EINVAL, SRQ, res.pd, SrqInitAttr(SrqAttr(max_wr=limit + 1, max_sge=1)))


# -- AH -------------------------------------------------------------------------------------

def test_ah_with_grh(res):
    assert res.ah() is not None


def test_ah_without_grh_is_einval_on_roce(res):
    raises_errno(errno.EINVAL, AH, res.pd, attr=AHAttr(is_global=0, port_num=1))


def empty_gid_index(ctx) -> int:
    return next(i for i in range(min(256, ctx.query_port(1).gid_tbl_len))
                if not ctx.query_gid(1, i))


def test_ah_with_an_empty_sgid_index(res, differs):
    av = AHAttr(is_global=1, port_num=1,
                gr=GlobalRoute(dgid=res.gid, sgid_index=empty_gid_index(res.ctx)))
    raises_errno(differs("empty_sgid_index"), AH, res.pd, attr=av)


# -- QP creation ----------------------------------------------------------------------------

@pytest.mark.parametrize("qpt", [E.IBV_QPT_RC, E.IBV_QPT_UC, E.IBV_QPT_UD])
def test_qp_create_with_caps(res, qpt):
    cap = QPCap(max_send_wr=5, max_recv_wr=9, max_send_sge=2, max_recv_sge=3,
                max_inline_data=20)
    qp = res.qp(qpt, cap)
    assert qp.qp_num >= 2  # 0 and 1 are the special QPs
    assert qp.qp_type == qpt
    attr, init = qp.query(E.IBV_QP_STATE | E.IBV_QP_CAP)
    assert attr.qp_state == E.IBV_QPS_RESET
    assert init.qp_type == qpt
    c = attr.cap
    # at least what was asked (rxe: rings of 2^k - 1, sge/inline from the WQE size)
    assert c.max_send_wr >= 5 and c.max_recv_wr >= 9
    assert c.max_send_sge >= 2 and c.max_recv_sge >= 3 and c.max_inline_data >= 20
    assert (c.max_send_wr, c.max_recv_wr) == (ring(5), ring(9))


def test_qp_numbers_are_distinct(res):
    qps = [res.qp(t) for t in (E.IBV_QPT_RC, E.IBV_QPT_UC, E.IBV_QPT_UD, E.IBV_QPT_RC)]
    assert len({q.qp_num for q in qps}) == 4


def test_qp_caps_above_the_device_limits_are_einval(res):
    a = res.ctx.query_device()
    for cap in (QPCap(max_send_wr=a.max_qp_wr + 1), QPCap(max_recv_wr=a.max_qp_wr + 1),
                QPCap(max_send_sge=a.max_sge + 1), QPCap(max_recv_sge=a.max_sge + 1)):
        ia = QPInitAttr(qp_type=E.IBV_QPT_RC, scq=res.cq, rcq=res.cq, cap=cap)
        raises_errno(errno.EINVAL, QP, res.pd, ia)


def test_qp_on_srq(res):
    srq = res.keep(SRQ(res.pd, SrqInitAttr(SrqAttr(max_wr=4, max_sge=1))))
    qp = res.qp(E.IBV_QPT_RC, QPCap(max_send_wr=2, max_recv_wr=1), srq=srq)
    raises_errno(errno.EBUSY, srq.close)  # a QP uses it
    qp.close()


def test_cq_in_use_by_a_qp_is_busy(res):
    cq = res.cq_(8)
    res.qp(E.IBV_QPT_RC, scq=cq, rcq=cq)
    raises_errno(errno.EBUSY, cq.close)



def test_cq_resize_below_the_completions_held_is_einval(res):
    cq = res.cq_(16)
    qp = res.qp(E.IBV_QPT_RC, QPCap(max_send_wr=1, max_recv_wr=8), rcq=cq)
    res.to_init(qp)
    for i in range(5):
        qp.post_recv(RecvWR(wr_id=i))
    qp.modify(QPAttr(qp_state=E.IBV_QPS_ERR), M.IBV_QP_STATE)  # five flushed receives
    (first,) = poll(cq, 1)
    assert first.wr_id == 0
    raises_errno(errno.EINVAL, cq.resize, 3)  # four still held
    cq.resize(4)
    assert cq.cqe == 7
    assert [w.wr_id for w in poll(cq, 4)] == [1, 2, 3, 4]


def test_recorded_differences_are_complete():
    for name, entry in DIFFERENCES.items():
        assert {"rule", "soft", "rxe"} <= set(entry), name
        assert len(entry["rule"]) > 40, name
        # the only other keys: a kernel series of rxe where it answers otherwise
        assert all(k.startswith("rxe 6.") for k in set(entry) - {"rule", "soft", "rxe"}), name
    assert device_kind("no-such-kernel-device") == "soft"


def test_kernel_series_entries_override_rxe_only():
    """An "rxe 6.12" entry is rxe's answer on 6.12; 6.1, another series and the soft device
    keep theirs (tests/conformance/conftest.py: expectation)."""
    entry = {"rule": "x", "soft": "s", "rxe": "r61", "rxe 6.12": "r612"}
    assert expectation(entry, "rxe", "6.12") == "r612"
    assert expectation(entry, "rxe", "6.1") == "r61"
    assert expectation(entry, "soft", "6.12") == "s"
    assert rxe_series("6.12.117+deb12-amd64") == "6.12"
    assert rxe_series("6.1.0-56-amd64") == "6.1"
