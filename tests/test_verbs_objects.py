"""The verbs objects: device and port queries, GIDs, PD/MR/MW and the key table, CQs and
completion channels (select, poll, asyncio), async events, SRQ limits, AHs, resource
lifetimes (EBUSY), and what post_send/post_recv accept in each state.

Expected values come from the references (rxe's limits and layouts in
rxe-and-pyverbs-facts.md A.7/A.8, the seed inventory §2), or are computed here
independently (modified EUI-64, ring rounding), never read back from the code under test.
"""

from __future__ import annotations

import array
import asyncio
import errno
import ipaddress
import mmap
import random
import select
import signal

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from softrdma.errors import PyverbsRDMAError
from softrdma.qp.memory import Access, AccessError, KeyTable
from softrdma.verbs_api import (
    AH, CQ, GID, MR, MW, PD, QP, SGE, SRQ, AHAttr, CompChannel, Context, GlobalRoute, MWBind,
    MWBindInfo, QPCap, QPInitAttr, RecvWR, SendWR, SrqAttr, SrqInitAttr, add_device,
    get_device_list, remove_device,
)
from softrdma.verbs_api import enums as E

from .verbs_helpers import (
    ERR, INIT, MASK_BITS, NO_SUCH_QPN, RC, RESET, RTR, RTS, SQD, UC, UD, Env, drive, full_attr,
    loopback_av,
)

A = E.ibv_access_flags
W = E.ibv_wr_opcode
LW, RW, RR, RA, MWB = (A.IBV_ACCESS_LOCAL_WRITE, A.IBV_ACCESS_REMOTE_WRITE,
                       A.IBV_ACCESS_REMOTE_READ, A.IBV_ACCESS_REMOTE_ATOMIC, A.IBV_ACCESS_MW_BIND)
FLUSH = E.IBV_WC_WR_FLUSH_ERR
DEV_NAME = "softrdma-objtest"
DEV_IP = "127.0.0.7"


@pytest.fixture(scope="module")
def dev():
    """A device of its own, so packets and events of other tests never reach it."""
    d = add_device(DEV_IP, name=DEV_NAME, live=False)  # stepped with progress()
    yield d
    remove_device(DEV_NAME)


@pytest.fixture
def ctx(dev):
    with Context(name=DEV_NAME) as c:
        yield c


@pytest.fixture
def env(ctx):
    e = Env(ctx)
    yield e


def raises(code, fn, *args, **kw):
    with pytest.raises(PyverbsRDMAError) as ei:
        fn(*args, **kw)
    assert ei.value.error_code == code, str(ei.value)
    assert ei.value.errno == code
    return ei.value


# -- devices, ports, GIDs --------------------------------------------------------------

def test_device_list_and_open_by_name(dev):
    names = [d.name for d in get_device_list()]
    assert b"softrdma0" in names and DEV_NAME.encode() in names
    assert all(isinstance(n, bytes) for n in names)
    for name in (DEV_NAME, DEV_NAME.encode()):
        with Context(name=name) as c:
            assert c.device is dev
    raises(errno.ENODEV, Context, name="no-such-device")


def test_add_and_remove_device_errors(dev):
    raises(errno.EEXIST, add_device, "127.0.0.8", name=DEV_NAME)
    with Context(name=DEV_NAME):
        raises(errno.EBUSY, remove_device, DEV_NAME)
    raises(errno.ENODEV, remove_device, "no-such-device")


def test_query_device_reports_rxe_limits(ctx):
    a = ctx.query_device()
    # rxe_param.h values (facts A.8)
    assert a.max_qp_wr == 0x4000
    assert a.max_sge == 32 and a.max_sge_rd == 32
    assert a.max_cqe == 32767 and a.max_cq == 16384
    assert a.max_qp_rd_atom == 128 and a.max_qp_init_rd_atom == 128
    assert a.max_srq_sge == 27
    assert a.max_pkeys == 64
    assert a.local_ca_ack_delay == 15
    assert a.phys_port_cnt == 1
    assert a.atomic_caps == E.IBV_ATOMIC_HCA
    # the node GUID is the interface ID of the link-local GID
    assert a.node_guid.to_bytes(8, "big") == ctx.query_gid(1, 0).raw[8:]


def _ib_mtu_enum(netdev_mtu):
    """rxe_set_mtu (facts A.7): the largest IB MTU <= netdev MTU - 80, within 256..4096."""
    usable = netdev_mtu - 80
    best = 1  # IBV_MTU_256
    for enum_value, size in ((1, 256), (2, 512), (3, 1024), (4, 2048), (5, 4096)):
        if size <= usable:
            best = enum_value
    return best


def test_query_port_loopback(ctx):
    p = ctx.query_port(1)
    assert p.state == E.IBV_PORT_ACTIVE
    assert p.max_mtu == E.IBV_MTU_4096
    assert p.active_mtu == E.IBV_MTU_4096  # lo has a 64 KiB MTU
    assert p.link_layer == E.IBV_LINK_LAYER_ETHERNET
    assert p.gid_tbl_len >= 2 and p.pkey_tbl_len == 64
    raises(errno.EINVAL, ctx.query_port, 2)
    raises(errno.EINVAL, ctx.query_port, 0)


@pytest.mark.parametrize("mtu,expected", [(1500, E.IBV_MTU_1024), (9000, E.IBV_MTU_4096),
                                          (1100, E.IBV_MTU_512), (2200, E.IBV_MTU_2048),
                                          (300, E.IBV_MTU_256)])
def test_active_mtu_follows_the_netdev_mtu(mtu, expected):
    assert _ib_mtu_enum(mtu) == expected  # the reference formula agrees with the table
    d = add_device("127.0.0.21", mtu=mtu)
    try:
        with Context(name=d.name) as c:
            assert c.query_port(1).active_mtu == expected
            assert c.query_port(1).max_mtu == E.IBV_MTU_4096
    finally:
        remove_device(d.name)


def modified_eui64_link_local(mac: bytes) -> bytes:
    """RFC 4291 appendix A: fe80::/64 + MAC with ff:fe in the middle and the U/L bit flipped."""
    iid = bytearray(mac[:3]) + b"\xff\xfe" + bytearray(mac[3:])
    iid[0] ^= 0x02
    return ipaddress.IPv6Address("fe80::").packed[:8] + bytes(iid)


def test_eui64_reference_vector():
    assert modified_eui64_link_local(bytes.fromhex("001122334455")) == \
        ipaddress.IPv6Address("fe80::211:22ff:fe33:4455").packed
    from softrdma.soft.netdev import eui64_link_local
    for mac in (bytes.fromhex("001122334455"), bytes.fromhex("02000a000001"),
                bytes.fromhex("fedcba987654")):
        assert eui64_link_local(mac) == modified_eui64_link_local(mac)


def test_gid_table_layout(ctx, dev):
    g0 = ctx.query_gid(1, 0)
    assert g0.raw == modified_eui64_link_local(dev.mac)
    assert g0.raw[:8] == bytes.fromhex("fe80000000000000")
    g1 = ctx.query_gid(1, 1)
    assert g1 == GID(f"::ffff:{DEV_IP}")
    assert g1.raw == bytes(10) + b"\xff\xff" + ipaddress.IPv4Address(DEV_IP).packed
    assert g1.gid == "0000:0000:0000:0000:0000:ffff:7f00:0007"
    for i in (0, 1):
        assert ctx.query_gid_type(1, i) == E.IBV_GID_TYPE_ROCE_V2
    assert not ctx.query_gid(1, 2)  # unpopulated entries are zero
    raises(errno.EINVAL, ctx.query_gid, 1, ctx.query_port(1).gid_tbl_len)
    raises(errno.EINVAL, ctx.query_gid, 2, 0)
    assert [(i, g) for i, g, _ in ctx.query_gid_table()] == [(0, g0), (1, g1)]


def test_query_pkey(ctx):
    assert ctx.query_pkey(1, 0) == 0xFFFF
    assert ctx.query_pkey(1, 63) == 0
    raises(errno.EINVAL, ctx.query_pkey, 1, 64)
    raises(errno.EINVAL, ctx.query_pkey, 2, 0)


# -- PD, MR, MW ------------------------------------------------------------------------

def test_mr_allocated_buffer(ctx):
    pd = PD(ctx)
    mr = MR(pd, 64, LW | RW | RR)
    assert mr.length == 64 and mr.lkey == mr.rkey and mr.buf % 4096 == 0
    mr.write(b"hello", 5, 3)
    assert mr.read(5, 3) == b"hello" and mr.read(3, 0) == bytes(3)
    raises(errno.EINVAL, mr.read, 10, 60)
    other = MR(pd, 64, LW)
    assert other.lkey != mr.lkey
    assert other.buf >= mr.buf + 64 or other.buf + 64 <= mr.buf  # iova ranges do not overlap


def test_mr_over_a_bytearray_shares_memory(ctx):
    pd = PD(ctx)
    buf = bytearray(b"x" * 100)
    mr = MR(pd, access=LW, buffer=buf)
    assert mr.length == 100
    mr.write(b"abc", 3, 10)
    assert buf[10:13] == b"abc"
    buf[0:2] = b"zz"
    assert mr.read(2, 0) == b"zz"
    assert MR(pd, 10, LW, buffer=buf).length == 10  # a prefix
    raises(errno.EINVAL, MR, pd, 101, LW, buffer=buf)


def test_mr_over_mmap_and_array(ctx):
    pd = PD(ctx)
    m = mmap.mmap(-1, 8192)
    mr = MR(pd, access=LW | RW, buffer=m)
    assert mr.length == 8192
    mr.write(b"mapped", 6, 4096)
    assert m[4096:4102] == b"mapped"
    mr.close()
    a = array.array("i", range(10))
    mr = MR(pd, access=LW, buffer=a)
    assert mr.length == 10 * a.itemsize
    mr.write((7).to_bytes(a.itemsize, "little"), a.itemsize, 0)
    assert a[0] == 7


def test_mr_over_numpy_arrays(ctx):
    pd = PD(ctx)
    x = np.zeros(16, dtype=np.uint32)
    mr = MR(pd, access=LW | RW | RA, buffer=x)
    assert mr.length == 64
    mr.write((0xDEADBEEF).to_bytes(4, "little"), 4, 8)
    assert x[2] == 0xDEADBEEF
    y = np.zeros((3, 4), dtype=np.float64)  # 2-D, C order
    assert MR(pd, access=LW, buffer=y).length == 96
    raises(errno.EINVAL, MR, pd, access=LW, buffer=np.zeros(10)[::2])  # strided
    f = np.asfortranarray(np.zeros((3, 4)))  # contiguous, but not in C order
    e = raises(errno.EINVAL, MR, pd, access=LW, buffer=f)
    assert "C-contiguous" in str(e)
    assert MR(pd, access=LW, buffer=np.ravel(f, order="K")).length == 96


def test_mr_access_rules(ctx):
    pd = PD(ctx)
    ro = b"read only bytes"
    raises(errno.EFAULT, MR, pd, access=LW, buffer=ro)
    raises(errno.EFAULT, MR, pd, access=LW | RW, buffer=memoryview(bytearray(8)).toreadonly())
    assert MR(pd, access=RR, buffer=ro).length == len(ro)  # read-only registrations are fine
    e = raises(errno.EINVAL, MR, pd, 16, RW)
    assert "IBV_ACCESS_LOCAL_WRITE" in str(e)
    raises(errno.EINVAL, MR, pd, 16, RA)
    raises(errno.EINVAL, MR, pd, 16, 1 << 15)  # unknown bit
    raises(errno.EINVAL, MR, pd, access=LW, buffer=12345)  # no buffer protocol


def test_mr_rereg_keeps_keys(ctx):
    """ibv_rereg_mr keeps the lkey and rkey, as rxe's rxe_rereg_user_mr (6.2 on) and
    hardware do, and the iova unless the translation changes: what changes is what the
    keys allow (the new access, the new PD, the new buffer)."""
    pd, pd2 = PD(ctx), PD(ctx)
    mr = MR(pd, 64, LW)
    old_lkey, old_rkey, old_iova = mr.lkey, mr.rkey, mr.buf
    keys = ctx.device.keys
    with pytest.raises(AccessError):  # no REMOTE_READ yet
        keys.resolve(old_rkey, pd, mr.buf, 8, Access.REMOTE_READ, remote=True)
    mr.rereg(4, access=LW | RR)  # IBV_REREG_MR_CHANGE_ACCESS
    assert (mr.lkey, mr.rkey, mr.buf) == (old_lkey, old_rkey, old_iova)
    assert mr.access == LW | RR
    assert len(keys.resolve(old_rkey, pd, mr.buf, 8, Access.REMOTE_READ, remote=True)) == 8
    mr.rereg(2, pd=pd2)  # CHANGE_PD
    assert mr.pd is pd2 and (mr.lkey, mr.rkey, mr.buf) == (old_lkey, old_rkey, old_iova)
    with pytest.raises(AccessError):
        keys.resolve(mr.lkey, pd, mr.buf, 8, 0, remote=False)
    keys.resolve(mr.lkey, pd2, mr.buf, 8, 0, remote=False)
    pd.close()  # the MR no longer holds the first PD
    raises(errno.EBUSY, pd2.close)
    raises(errno.EINVAL, mr.rereg, 2, pd=None)
    dead = PD(ctx)
    dead.close()
    raises(errno.EBADF, mr.rereg, 2, pd=dead)
    ro = MR(pd2, access=RR, buffer=b"immutable")
    raises(errno.EFAULT, ro.rereg, 4, access=LW)
    assert ro.access == RR  # a refused rereg changes nothing
    new = bytearray(32)
    mr.rereg(1, addr=new)  # CHANGE_TRANSLATION: a new buffer, the same keys
    assert mr.length == 32 and (mr.lkey, mr.rkey) == (old_lkey, old_rkey)
    mr.write(b"q", 1, 31)
    assert new[31:] == b"q"
    assert bytes(keys.resolve(mr.lkey, pd2, mr.buf + 31, 1, 0, remote=False)) == b"q"


def test_mw_alloc(ctx):
    pd = PD(ctx)
    mw1, mw2 = MW(pd, E.IBV_MW_TYPE_1), MW(pd, E.IBV_MW_TYPE_2)
    assert mw1.mw_type == 1 and mw2.mw_type == 2 and mw1.rkey != mw2.rkey
    mr = MR(pd, 64, LW)
    assert {mw1.rkey >> 8, mw2.rkey >> 8}.isdisjoint({mr.lkey >> 8})  # MW and MR index ranges
    raises(errno.EINVAL, MW, pd, 3)
    raises(errno.EBUSY, pd.close)
    mw1.close(), mw2.close(), mr.close()
    pd.close()


def test_mr_dereg_with_a_bound_window_is_einval(env):
    ctx = env.ctx
    qp = env.qp(RC)
    drive(ctx, qp, RTS)
    mr = MR(env.pd, 4096, LW | RR | MWB)
    mw = MW(env.pd, E.IBV_MW_TYPE_1)
    qp.bind_mw(mw, MWBind(MWBindInfo(mr, mr.buf, 100, RR), E.IBV_SEND_SIGNALED, 99))
    wcs = env.cq.poll_all()
    assert [(w.wr_id, w.status) for w in wcs] == [(99, E.IBV_WC_SUCCESS)]
    raises(errno.EINVAL, mr.close)  # rxe_dereg_mr refuses while windows are bound
    assert not mr.closed
    mw.close()
    mr.close()
    qp.close()


# -- the key table: a property test ------------------------------------------------------

class _PD:
    pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_key_table_resolve_never_escapes_the_range(data):
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    keys = KeyTable(rng)
    pds = [_PD(), _PD()]
    regions = []  # (entry, backing bytearray, pd, access)
    for i in range(data.draw(st.integers(1, 4))):
        size = data.draw(st.integers(0, 300))
        backing = bytearray(rng.randbytes(size + 64))
        lo = data.draw(st.integers(0, 32))
        view = memoryview(backing)[lo:lo + size]  # the MR covers only part of the bytearray
        pd = data.draw(st.sampled_from(pds))
        access = data.draw(st.integers(0, 15))
        e = keys.register_mr(pd, view, access)
        regions.append((e, backing, lo, pd, access))
    if data.draw(st.booleans()):  # one removed (deregistered) region: its key is stale
        e = regions.pop()[0]
        keys.remove(e)
        stale_key = e.lkey
    else:
        stale_key = None

    for _ in range(12):
        choice = data.draw(st.integers(0, len(regions) + 1))
        if choice < len(regions):
            e, backing, lo, pd, access = regions[choice]
            key = e.lkey
            if data.draw(st.integers(0, 9)) == 0:
                key ^= 1 << data.draw(st.integers(0, 7))  # wrong key byte
        else:
            e = None
            key = stale_key if stale_key is not None and choice == len(regions) else \
                data.draw(st.integers(0, 2**32 - 1))
        base = e.iova if e is not None else data.draw(st.integers(0, 2**48))
        size = e.length if e is not None else 100
        iova = base + data.draw(st.integers(-8, size + 8))
        length = data.draw(st.integers(-2, size + 8))
        need = data.draw(st.integers(0, 15))
        use_pd = data.draw(st.sampled_from(pds + [None]))
        remote = data.draw(st.booleans())

        # the model: which lookups must succeed
        ok = (e is not None and key == e.lkey and (use_pd is None or use_pd is pd)
              and not need & ~access
              and (length == 0 or (length > 0 and e.iova <= iova and iova + length <= e.iova
                                   + e.length)))
        try:
            got = keys.resolve(key, use_pd, iova, length, need, remote=remote)
        except AccessError as err:
            assert not ok, (err.reason, str(err))
            continue
        assert ok, "resolve accepted an access the model forbids"
        assert len(got) == length
        if length:
            off = lo + (iova - e.iova)
            assert bytes(got) == bytes(backing[off:off + length])
            if not got.readonly:  # writes land exactly inside the range
                before = bytes(backing)
                got[:] = b"\xa5" * length
                after = bytes(backing)
                assert after[:off] == before[:off]
                assert after[off + length:] == before[off + length:]


def test_key_table_windows():
    keys = KeyTable(random.Random(1))
    pd, other_pd = _PD(), _PD()
    backing = bytearray(range(256))
    mr = keys.register_mr(pd, memoryview(backing), int(LW | RW | RR | MWB))
    mw = keys.alloc_mw(pd, 2)
    with pytest.raises(AccessError):  # an unbound window resolves nothing
        keys.resolve(mw.rkey, pd, mr.iova, 1, int(RR), remote=True)
    # bind it by hand (the data path does this for a BIND_MW WR) to [16, 48) read-only
    qp_a, qp_b = object(), object()
    mw.mr, mw.iova, mw.length, mw.access, mw.valid, mw.qp = mr, mr.iova + 16, 32, int(RR), True, qp_a
    mr.refs += 1
    assert bytes(keys.resolve(mw.rkey, pd, mr.iova + 16, 32, int(RR), remote=True, qp=qp_a)) == \
        bytes(range(16, 48))
    for args in ((mr.iova + 15, 2), (mr.iova + 47, 2), (mr.iova, 1)):
        with pytest.raises(AccessError):
            keys.resolve(mw.rkey, pd, *args, int(RR), remote=True, qp=qp_a)
    with pytest.raises(AccessError):  # write not granted by the window
        keys.resolve(mw.rkey, pd, mr.iova + 16, 4, int(RW), remote=True, qp=qp_a)
    with pytest.raises(AccessError):  # a type 2 window is tied to its QP
        keys.resolve(mw.rkey, pd, mr.iova + 16, 4, int(RR), remote=True, qp=qp_b)
    with pytest.raises(AccessError):  # windows are rkeys, never lkeys
        keys.resolve(mw.rkey, pd, mr.iova + 16, 4, 0, remote=False, qp=qp_a)
    with pytest.raises(AccessError):
        keys.resolve(mw.rkey, other_pd, mr.iova + 16, 4, int(RR), remote=True, qp=qp_a)


# -- CQs, completion channels, async events ---------------------------------------------

def _ring(n):
    slots = 1
    while slots < n + 1:
        slots *= 2
    return slots - 1


def flush_recvs(env, cq, n, wr_id0=1000):
    """Make ``n`` completions on ``cq`` without a peer: receives flushed by a move to ERR."""
    qp = env.qp(RC, rcq=cq, cap=QPCap(max_send_wr=1, max_recv_wr=max(n, 1)))
    drive(env.ctx, qp, INIT)
    for i in range(n):
        qp.post_recv(RecvWR(wr_id=wr_id0 + i))
    qp.modify(full_attr(env.ctx, ERR, INIT), MASK_BITS["STATE"])
    qp.close()


@pytest.mark.parametrize("cqe", [1, 2, 3, 100, 127, 128, 4096, 32767])
def test_cq_capacity_rounding(ctx, cqe):
    cq = CQ(ctx, cqe, None, None, 0)
    assert cq.cqe == _ring(cqe)
    cq.close()


def test_cq_capacity_errors(ctx):
    raises(errno.EINVAL, CQ, ctx, 0)
    raises(errno.EINVAL, CQ, ctx, 32768)
    raises(errno.EINVAL, CQ, ctx, 10, None, None, 1)  # comp_vector
    dead = Context(name=DEV_NAME)
    n = ctx.device.in_use["cq"]
    dead.close()
    raises(errno.EBADF, CQ, dead, 10)
    assert ctx.device.in_use["cq"] == n  # no CQ accounted for the failed create


def test_cq_is_truthy_even_when_empty(ctx):
    cq = CQ(ctx, 4)
    assert len(cq) == 0 and bool(cq)


def test_cq_overflow_drops_and_raises_cq_err(env):
    ctx = env.ctx
    cq = CQ(ctx, 1)
    assert cq.cqe == 1
    assert ctx.get_async_event(block=False) is None
    flush_recvs(env, cq, 3)
    n, wcs = cq.poll(10)
    assert n == 1 and wcs[0].wr_id == 1000 and wcs[0].status == FLUSH
    ev = ctx.get_async_event(block=False)
    assert ev is not None and ev.event_type == E.IBV_EVENT_CQ_ERR and ev.element is cq
    ev.ack()


def test_cq_poll_iteration_and_poll_all(env):
    cq = CQ(env.ctx, 16)
    flush_recvs(env, cq, 5)
    assert len(cq) == 5
    n, first = cq.poll(2)
    assert n == 2 and [w.wr_id for w in first] == [1000, 1001]
    assert [w.wr_id for w in cq] == [1002, 1003, 1004]
    assert cq.poll_all() == [] and cq.poll() == (0, [])
    flush_recvs(env, cq, 3, wr_id0=7)
    assert [w.wr_id for w in cq.poll_all()] == [7, 8, 9]


def test_comp_channel_with_select(env):
    ctx = env.ctx
    ch = CompChannel(ctx)
    cq = CQ(ctx, 16, None, ch, 0)
    flush_recvs(env, cq, 1)  # not armed: no event
    assert select.select([ch.fd], [], [], 0)[0] == []
    raises(errno.ETIMEDOUT, ch.get_cq_event, cq, timeout=0.01)
    cq.req_notify()
    assert select.select([ch.fd], [], [], 0)[0] == []
    flush_recvs(env, cq, 2)  # armed: exactly one event for the next completion(s)
    assert select.select([ch.fd], [], [], 1.0)[0] == [ch.fd]
    assert ch.get_cq_event(cq) is cq
    assert select.select([ch.fd], [], [], 0)[0] == []  # one event, not one per completion
    cq.ack_events(1)
    assert len(cq.poll_all()) == 3
    flush_recvs(env, cq, 1)  # disarmed after the event
    assert select.select([ch.fd], [], [], 0)[0] == []
    cq.poll_all()


def test_comp_channel_with_poll(env):
    ctx = env.ctx
    ch = CompChannel(ctx)
    cq = CQ(ctx, 16, None, ch, 0)
    p = select.poll()
    p.register(ch.fd, select.POLLIN)
    assert p.poll(0) == []
    cq.req_notify()
    flush_recvs(env, cq, 1)
    assert p.poll(1000) == [(ch.fd, select.POLLIN)]
    assert ch.get_cq_event(timeout=1) is cq
    cq.ack_events(1)
    assert p.poll(0) == []


def test_comp_channel_with_asyncio_wait_async(env):
    ctx = env.ctx
    ch = CompChannel(ctx)
    cq = CQ(ctx, 16, None, ch, 0)

    async def main():
        cq.req_notify()
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, flush_recvs, env, cq, 2)
        got = await asyncio.wait_for(ch.wait_async(), 2)
        return got

    assert asyncio.run(main()) is cq
    cq.ack_events(1)
    assert [w.wr_id for w in cq.poll_all()] == [1000, 1001]


def test_comp_channel_with_asyncio_add_reader(env):
    ctx = env.ctx
    ch = CompChannel(ctx)
    cq = CQ(ctx, 16, None, ch, 0)

    async def main():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        loop.add_reader(ch.fd, lambda: fut.done() or fut.set_result(ch.get_cq_event()))
        try:
            cq.req_notify()
            loop.call_soon(flush_recvs, env, cq, 1)
            return await asyncio.wait_for(fut, 2)
        finally:
            loop.remove_reader(ch.fd)

    assert asyncio.run(main()) is cq
    cq.ack_events(1)


def _ud_pair(env, rcq):
    ctx = env.ctx
    a, b = env.qp(UD), env.qp(UD, rcq=rcq)
    drive(ctx, a, RTS)
    drive(ctx, b, RTS)
    mr = MR(env.pd, 4096, LW)
    ah = AH(env.pd, attr=loopback_av(ctx))
    return a, b, mr, ah


def _ud_send(env, a, b, mr, ah, wr_id, flags):
    wr = SendWR(wr_id=wr_id, sg=[SGE(mr.buf, 8, mr.lkey)], send_flags=flags)
    wr.set_wr_ud(ah, b.qp_num, 0x11111111)
    a.post_send(wr)
    while env.ctx.device.progress():  # deliver the looped-back packet
        pass


def test_solicited_only_arming(env):
    ctx = env.ctx
    ch = CompChannel(ctx)
    rcq = CQ(ctx, 16, None, ch, 0)
    a, b, mr, ah = _ud_pair(env, rcq)
    for i in range(3):
        b.post_recv(RecvWR(wr_id=i, sg=[SGE(mr.buf, 4096, mr.lkey)]))
    rcq.req_notify(solicited_only=True)
    _ud_send(env, a, b, mr, ah, 10, E.IBV_SEND_SIGNALED)
    assert len(rcq) == 1 and select.select([ch.fd], [], [], 0)[0] == []
    _ud_send(env, a, b, mr, ah, 11, E.IBV_SEND_SIGNALED | E.IBV_SEND_SOLICITED)
    assert len(rcq) == 2 and select.select([ch.fd], [], [], 0)[0] == [ch.fd]
    assert ch.get_cq_event(rcq) is rcq
    rcq.ack_events(1)
    # arming for "all" after "solicited only" widens it: the next completion fires
    rcq.req_notify(solicited_only=True)
    rcq.req_notify()
    _ud_send(env, a, b, mr, ah, 12, E.IBV_SEND_SIGNALED)
    assert select.select([ch.fd], [], [], 0)[0] == [ch.fd]
    ch.get_cq_event(rcq)
    rcq.ack_events(1)
    assert [w.wr_id for w in rcq.poll_all()] == [0, 1, 2]
    env.cq.poll_all()


def test_ack_events_accounting_and_destroy(env):
    ctx = env.ctx
    ch = CompChannel(ctx)
    cq = CQ(ctx, 64, None, ch, 0)
    for _ in range(2):
        cq.req_notify()
        flush_recvs(env, cq, 1)
        ch.get_cq_event(cq)
    raises(errno.EINVAL, cq.ack_events, 3)
    raises(errno.EINVAL, cq.ack_events, -1)
    raises(errno.EBUSY, cq.close)  # ibv_destroy_cq would wait for the acks forever
    raises(errno.EBUSY, ch.close)  # the channel still has a CQ
    cq.ack_events(1)
    raises(errno.EBUSY, cq.close)
    cq.ack_events(1)
    cq.close()
    ch.close()
    assert cq.closed and ch.closed


def test_cq_event_for_another_cq(env):
    ctx = env.ctx
    ch = CompChannel(ctx)
    cq1, cq2 = CQ(ctx, 8, None, ch, 0), CQ(ctx, 8, None, ch, 0)
    cq1.req_notify()
    flush_recvs(env, cq1, 1)
    raises(errno.EINVAL, ch.get_cq_event, cq2, timeout=1)
    cq1.ack_events(1)  # the event was consumed (and counted on its CQ)


def test_cq_resize(env):
    cq = CQ(env.ctx, 10)
    assert cq.cqe == 15
    cq.resize(100)
    assert cq.cqe == 127
    flush_recvs(env, cq, 5)
    raises(errno.EINVAL, cq.resize, 3)  # fewer than the completions held
    raises(errno.EINVAL, cq.resize, 0)
    raises(errno.EINVAL, cq.resize, 32768)
    cq.resize(5)
    assert cq.cqe == 7 and len(cq) == 5
    assert [w.wr_id for w in cq.poll_all()] == list(range(1000, 1005))


def test_async_event_fd(env):
    ctx = env.ctx
    assert select.select([ctx.async_fd], [], [], 0)[0] == []
    cq = CQ(ctx, 1)
    flush_recvs(env, cq, 2)  # one too many: CQ_ERR
    assert select.select([ctx.async_fd], [], [], 1.0)[0] == [ctx.async_fd]
    ev = ctx.get_async_event()
    assert ev.event_type == E.IBV_EVENT_CQ_ERR
    assert select.select([ctx.async_fd], [], [], 0)[0] == []
    assert ctx.get_async_event(block=False) is None


def test_async_events_go_to_the_owning_context(env, dev):
    with Context(name=DEV_NAME) as other:
        cq = CQ(env.ctx, 1)
        flush_recvs(env, cq, 2)
        assert env.ctx.get_async_event(block=False).element is cq
        assert other.get_async_event(block=False) is None


def test_unread_async_events_never_block(env):
    """Most programs never read async events: the device must not block on a full pipe."""
    from softrdma.verbs_api import AsyncEvent
    ctx = env.ctx

    def hung(signum, frame):
        raise AssertionError("emitting async events blocked (a full pipe?)")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        for _ in range(70000):  # more than a pipe buffer (64 KiB) holds, if each wrote a byte
            ctx.device.emit_async(AsyncEvent(E.IBV_EVENT_PORT_ACTIVE, 1))  # as the engines do
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    n = 0
    while ctx.get_async_event(block=False) is not None:
        n += 1
        if n == 1:  # the fd stays readable while events remain
            assert select.select([ctx.async_fd], [], [], 0)[0] == [ctx.async_fd]
    assert n == 70000
    assert select.select([ctx.async_fd], [], [], 0)[0] == []


# -- SRQ -----------------------------------------------------------------------------------

def test_srq_limit_event(env):
    ctx = env.ctx
    srq = SRQ(env.pd, SrqInitAttr(SrqAttr(max_wr=16, max_sge=1)))
    assert srq.query().max_wr == _ring(16)
    for i in range(10):
        srq.post_recv(RecvWR(wr_id=i))
    srq.modify(SrqAttr(srq_limit=5), E.IBV_SRQ_LIMIT)
    assert srq.query().srq_limit == 5
    remaining = 10
    fired_at = None
    while remaining:
        srq.take()
        remaining -= 1
        ev = ctx.get_async_event(block=False)
        if ev is not None:
            assert ev.event_type == E.IBV_EVENT_SRQ_LIMIT_REACHED and ev.element is srq
            assert fired_at is None, "the limit fires once, then disarms"
            fired_at = remaining
    assert fired_at == 4  # the first time fewer than 5 receives are left
    assert srq.query().srq_limit == 0  # disarmed
    assert srq.take() is None


def test_srq_errors(env):
    pd = env.pd
    raises(errno.EINVAL, SRQ, pd, SrqInitAttr(SrqAttr(max_wr=0x4001)))
    raises(errno.EINVAL, SRQ, pd, SrqInitAttr(SrqAttr(max_wr=8, max_sge=28)))
    raises(errno.EINVAL, SRQ, pd, SrqInitAttr(SrqAttr(max_wr=8, srq_limit=9)))
    srq = SRQ(pd, SrqInitAttr(SrqAttr(max_wr=2, max_sge=1)))
    assert srq.query().max_wr == 3
    raises(errno.EINVAL, srq.modify, SrqAttr(srq_limit=4), E.IBV_SRQ_LIMIT)
    mr = MR(pd, 64, LW)
    e = raises(errno.EINVAL, srq.post_recv, RecvWR(sg=[SGE(mr.buf, 8, mr.lkey)] * 2))
    assert e.bad_wr_index == 0
    srq.post_recv([RecvWR(wr_id=i) for i in range(3)])
    e = raises(errno.ENOMEM, srq.post_recv, RecvWR(wr_id=9))
    assert e.bad_wr.wr_id == 9
    qp = env.qp(RC, srq=srq)
    assert qp.query()[1].cap.max_recv_wr == 0
    drive(env.ctx, qp, INIT)
    raises(errno.EINVAL, qp.post_recv, RecvWR())  # receives go to the SRQ
    raises(errno.EBUSY, srq.close)
    qp.close()
    srq.close()


# -- AH ------------------------------------------------------------------------------------

def test_ah_creation_and_errors(env):
    ctx, pd = env.ctx, env.pd
    gid = ctx.query_gid(1, 1)
    ah = AH(pd, attr=AHAttr(is_global=1, port_num=1, gr=GlobalRoute(
        dgid=gid, sgid_index=1, hop_limit=64, traffic_class=0x20, flow_label=0x12345)))
    assert ah.av.dst_ip == ipaddress.IPv4Address(DEV_IP).packed
    assert (ah.av.hop_limit, ah.av.traffic_class, ah.av.flow_label) == (64, 0x20, 0x12345)
    assert AH(pd, attr=AHAttr(is_global=1, gr=GlobalRoute(dgid=GID("10.1.2.3"), sgid_index=1))) \
        .av.dst_ip == bytes([10, 1, 2, 3])

    def bad(**gr):
        base = dict(dgid=gid, sgid_index=1)
        base.update(gr)
        return AHAttr(is_global=1, port_num=1, gr=GlobalRoute(**base))

    raises(errno.EINVAL, AH, pd, attr=None)
    raises(errno.EINVAL, AH, pd, attr=AHAttr(port_num=1))  # no GRH on RoCE
    raises(errno.EINVAL, AH, pd, attr=AHAttr(is_global=0, gr=GlobalRoute(dgid=gid, sgid_index=1)))
    raises(errno.EINVAL, AH, pd, attr=bad(dgid=GID()))  # zero dgid
    raises(errno.EINVAL, AH, pd, attr=bad(sgid_index=2))
    raises(errno.EINVAL, AH, pd, attr=bad(sgid_index=1024))
    raises(errno.EINVAL, AH, pd, attr=bad(hop_limit=256))
    raises(errno.EINVAL, AH, pd, attr=bad(flow_label=1 << 20))
    raises(errno.EINVAL, AH, pd, attr=bad(traffic_class=256))
    raises(errno.EINVAL, AH, pd, attr=bad(dgid=GID("2001:db8::1")))  # IPv6 dgid, IPv4 sgid
    raises(errno.EINVAL, AH, pd, attr=AHAttr(is_global=1, port_num=2,
                                             gr=GlobalRoute(dgid=gid, sgid_index=1)))
    raises(errno.EBUSY, pd.close)
    ah.close()


# -- lifetimes -----------------------------------------------------------------------------

def test_busy_resources(ctx):
    pd = PD(ctx)
    mr = MR(pd, 16, LW)
    raises(errno.EBUSY, pd.close)
    mr.close()
    ch = CompChannel(ctx)
    cq = CQ(ctx, 8, None, ch, 0)
    raises(errno.EBUSY, ch.close)
    srq = SRQ(pd, SrqInitAttr(SrqAttr(max_wr=4)))
    qp = QP(pd, QPInitAttr(qp_type=RC, scq=cq, rcq=cq, srq=srq, cap=QPCap()))
    for res in (pd, cq, srq, ch):
        raises(errno.EBUSY, res.close)
        assert not res.closed
    qp.close()
    raises(errno.EBUSY, pd.close)  # the SRQ still holds it
    srq.close()
    raises(errno.EBUSY, ch.close)
    cq.close()
    ch.close()
    pd.close()
    assert all(r.closed for r in (pd, cq, srq, ch, qp))
    qp.close()  # idempotent
    raises(errno.EBADF, qp.post_recv, RecvWR())
    raises(errno.EBADF, cq.poll)
    raises(errno.EBADF, MR, pd, 16, LW)


def test_context_manager_closes_everything(dev):
    before = (dict(dev.in_use), len(dev.qps), len(dev.keys.entries),
              dev.contexts)
    with Context(name=DEV_NAME) as c:
        e = Env(c)
        ch = CompChannel(c)
        cq = CQ(c, 8, None, ch, 0)
        srq = SRQ(e.pd, SrqInitAttr())
        qps = [e.qp(t) for t in (RC, UC, UD)] + [e.qp(RC, srq=srq, scq=cq, rcq=cq)]
        drive(c, qps[0], RTS)
        mr = MR(e.pd, 64, LW | MWB)
        mw = MW(e.pd, 2)
        ah = AH(e.pd, attr=loopback_av(c))
        cq.req_notify()
        flush_recvs(e, cq, 1)
        ch.get_cq_event(cq)  # an unacknowledged event does not stop the context closing
        objs = [e.pd, e.cq, ch, cq, srq, mr, mw, ah] + qps
        assert dev.contexts == before[-1] + 1
        assert all(dev.in_use[k] > before[0][k] for k in ("pd", "cq", "srq", "qp", "mr", "mw", "ah"))
    assert all(o.closed for o in objs)
    assert c.closed
    assert (dict(dev.in_use), len(dev.qps), len(dev.keys.entries),
            dev.contexts) == before
    raises(errno.EBADF, PD, c)
    raises(errno.EBADF, c.query_port, 1)
    c.close()  # idempotent


# -- posting rules -------------------------------------------------------------------------

# Opcodes per QP type, transcribed from seed-inventory §2.1 (TSO, listed for UD by the seed,
# is not implemented by rxe, so it is refused everywhere).
OPS = {
    RC: {W.IBV_WR_SEND, W.IBV_WR_SEND_WITH_IMM, W.IBV_WR_RDMA_WRITE, W.IBV_WR_RDMA_WRITE_WITH_IMM,
         W.IBV_WR_RDMA_READ, W.IBV_WR_ATOMIC_CMP_AND_SWP, W.IBV_WR_ATOMIC_FETCH_AND_ADD,
         W.IBV_WR_LOCAL_INV, W.IBV_WR_BIND_MW, W.IBV_WR_SEND_WITH_INV},
    UC: {W.IBV_WR_SEND, W.IBV_WR_SEND_WITH_IMM, W.IBV_WR_RDMA_WRITE, W.IBV_WR_RDMA_WRITE_WITH_IMM,
         W.IBV_WR_LOCAL_INV, W.IBV_WR_BIND_MW, W.IBV_WR_SEND_WITH_INV},
    UD: {W.IBV_WR_SEND, W.IBV_WR_SEND_WITH_IMM},
}
ALL_OPS = [W.IBV_WR_RDMA_WRITE, W.IBV_WR_RDMA_WRITE_WITH_IMM, W.IBV_WR_SEND,
           W.IBV_WR_SEND_WITH_IMM, W.IBV_WR_RDMA_READ, W.IBV_WR_ATOMIC_CMP_AND_SWP,
           W.IBV_WR_ATOMIC_FETCH_AND_ADD, W.IBV_WR_LOCAL_INV, W.IBV_WR_BIND_MW,
           W.IBV_WR_SEND_WITH_INV, W.IBV_WR_TSO]


class Posting:
    """A QP with the bits needed to build any WR for it."""

    def __init__(self, env, qpt, state, **kw):
        self.env, self.qpt = env, qpt
        self.qp = env.qp(qpt, **kw)
        drive(env.ctx, self.qp, state)
        self.mr = MR(env.pd, 4096, LW | RW | RR | RA | MWB)
        self.ah = AH(env.pd, attr=loopback_av(env.ctx)) if qpt == UD else None

    def wr(self, opcode=W.IBV_WR_SEND, wr_id=1, nbytes=8, flags=0, **kw):
        sg = [SGE(self.mr.buf, nbytes, self.mr.lkey)] if nbytes else []
        if opcode in (W.IBV_WR_ATOMIC_CMP_AND_SWP, W.IBV_WR_ATOMIC_FETCH_AND_ADD):
            sg = [SGE(self.mr.buf, 8, self.mr.lkey)]
        if opcode in (W.IBV_WR_BIND_MW, W.IBV_WR_LOCAL_INV):
            sg = []
        wr = SendWR(wr_id=wr_id, opcode=opcode, sg=sg, send_flags=flags)
        if opcode in (W.IBV_WR_RDMA_WRITE, W.IBV_WR_RDMA_WRITE_WITH_IMM, W.IBV_WR_RDMA_READ):
            wr.set_wr_rdma(self.mr.rkey, self.mr.buf)
        if opcode in (W.IBV_WR_ATOMIC_CMP_AND_SWP, W.IBV_WR_ATOMIC_FETCH_AND_ADD):
            wr.set_wr_atomic(self.mr.rkey, kw.get("remote_addr", self.mr.buf + 64), 1, 2)
        if opcode == W.IBV_WR_BIND_MW:
            wr.set_bind_wr(MW(self.env.pd, 2), MWBindInfo(self.mr, self.mr.buf, 64, RR))
        if opcode in (W.IBV_WR_LOCAL_INV, W.IBV_WR_SEND_WITH_INV):
            wr.invalidate_rkey = 0x1234
        if self.qpt == UD:
            wr.set_wr_ud(self.ah, NO_SUCH_QPN, 0x11111111)
        return wr

    def close(self):
        self.qp.close()


@pytest.mark.parametrize("qpt", [RC, UC, UD])
def test_post_recv_rules_per_state(env, qpt):
    qp = env.qp(qpt)
    e = raises(errno.EINVAL, qp.post_recv, RecvWR(wr_id=5))
    assert "RESET" in str(e)
    drive(env.ctx, qp, INIT)
    qp.post_recv(RecvWR(wr_id=6))
    assert [r.wr_id for r in qp.rq] == [6]
    qp.close()


@pytest.mark.parametrize("state", [RESET, INIT, RTR])
@pytest.mark.parametrize("qpt", [RC, UC, UD])
def test_post_send_before_rts_is_einval(env, qpt, state):
    p = Posting(env, qpt, state)
    e = raises(errno.EINVAL, p.qp.post_send, p.wr())
    assert ["RESET", "INIT", "RTR"][state] in str(e)
    assert len(p.qp.sq) == 0
    p.close()


@pytest.mark.parametrize("qpt", [RC, UC, UD])
def test_opcodes_per_qp_type(env, qpt):
    # SQD: WRs are accepted but no new message starts, so nothing leaves the queue
    p = Posting(env, qpt, SQD, cap=QPCap(max_send_wr=32, max_send_sge=2))
    for op in ALL_OPS:
        if op in OPS[qpt]:
            p.qp.post_send(p.wr(op, wr_id=int(op)))
            assert p.qp.sq[-1].wr_id == int(op)
        else:
            n = len(p.qp.sq)
            e = raises(errno.EINVAL, p.qp.post_send, p.wr(op))
            assert E.ibv_wr_opcode(op).name in str(e)
            assert len(p.qp.sq) == n
    p.close()


def test_rdma_read_on_uc_and_write_on_ud(env):
    uc = Posting(env, UC, RTS)
    raises(errno.EINVAL, uc.qp.post_send, uc.wr(W.IBV_WR_RDMA_READ))
    ud = Posting(env, UD, RTS)
    raises(errno.EINVAL, ud.qp.post_send, ud.wr(W.IBV_WR_RDMA_WRITE))
    uc.close(), ud.close()


def test_sge_inline_queue_and_atomic_checks(env):
    cap = QPCap(max_send_wr=2, max_recv_wr=2, max_send_sge=2, max_recv_sge=2)
    p = Posting(env, RC, SQD, cap=cap)
    qp, mr = p.qp, p.mr
    got = qp.query()[1].cap
    assert (got.max_send_sge, got.max_inline_data, got.max_send_wr) == (2, 32, 3)
    sge = SGE(mr.buf, 4, mr.lkey)
    e = raises(errno.EINVAL, qp.post_send, SendWR(sg=[sge] * 3))
    assert "num_sge" in str(e)
    raises(errno.EINVAL, qp.post_send, SendWR(sg=[sge], num_sge=2))  # more than given
    e = raises(errno.EINVAL, qp.post_recv, RecvWR(sg=[sge] * 3))
    assert "num_sge" in str(e)
    e = raises(errno.EINVAL, qp.post_send, SendWR(sg=[SGE(mr.buf, 33, mr.lkey)],
                                                  send_flags=E.IBV_SEND_INLINE))
    assert "max_inline_data" in str(e)
    qp.post_send(SendWR(wr_id=1, sg=[SGE(mr.buf, 32, mr.lkey)], send_flags=E.IBV_SEND_INLINE))
    assert qp.sq[-1].inline == bytes(32)
    raises(errno.EINVAL, qp.post_send, p.wr(W.IBV_WR_ATOMIC_FETCH_AND_ADD,
                                            remote_addr=mr.buf + 4))
    raises(errno.EINVAL, qp.post_send, SendWR(opcode=W.IBV_WR_ATOMIC_CMP_AND_SWP,
                                              sg=[SGE(mr.buf, 4, mr.lkey)]))
    qp.post_send(p.wr(W.IBV_WR_ATOMIC_FETCH_AND_ADD, wr_id=2, remote_addr=mr.buf + 8))
    qp.post_send(p.wr(wr_id=3))
    assert [w.wr_id for w in qp.sq] == [1, 2, 3]
    e = raises(errno.ENOMEM, qp.post_send, p.wr(wr_id=4))
    assert "full" in str(e)
    for i in range(3):
        qp.post_recv(RecvWR(wr_id=i))
    raises(errno.ENOMEM, qp.post_recv, RecvWR(wr_id=9))
    p.close()


def test_lkeys_are_checked_when_data_moves_not_at_post(env):
    """As rxe: a bad lkey is accepted by post_send and fails the WR with LOC_PROT_ERR."""
    p = Posting(env, UD, RTS)
    wr = p.wr(wr_id=77)
    wr.sg_list = [SGE(p.mr.buf, 8, p.mr.lkey ^ 0xFF)]
    p.qp.post_send(wr)  # no exception
    wcs = env.cq.poll_all()
    assert [(w.wr_id, w.status) for w in wcs] == [(77, E.IBV_WC_LOC_PROT_ERR)]
    p.close()


@pytest.mark.parametrize("as_list", [True, False])
def test_failure_names_the_bad_wr_and_keeps_earlier_ones(env, as_list):
    p = Posting(env, UC, SQD, cap=QPCap(max_send_wr=8))
    wrs = [p.wr(wr_id=1), p.wr(wr_id=2), p.wr(W.IBV_WR_RDMA_READ, wr_id=3), p.wr(wr_id=4)]
    if not as_list:
        for a, b in zip(wrs, wrs[1:]):
            a.next_wr = b
    bad = SendWR()
    with pytest.raises(PyverbsRDMAError) as ei:
        p.qp.post_send(wrs if as_list else wrs[0], bad)
    e = ei.value
    assert e.error_code == errno.EINVAL
    assert e.bad_wr is wrs[2] and e.bad_wr_index == 2
    assert bad.wr_id == 3 and bad.opcode == W.IBV_WR_RDMA_READ
    assert [w.wr_id for w in p.qp.sq] == [1, 2]  # the earlier WRs stay posted
    # receives likewise
    rq_bad = RecvWR()
    with pytest.raises(PyverbsRDMAError) as ei:
        p.qp.post_recv([RecvWR(wr_id=10), RecvWR(wr_id=11, sg=[SGE(0, 1, 0)] * 5)], rq_bad)
    assert ei.value.bad_wr_index == 1 and rq_bad.wr_id == 11
    assert [r.wr_id for r in p.qp.rq] == [10]
    p.close()


def test_err_flushes_both_queues_in_post_order(env):
    ctx = env.ctx
    scq, rcq = CQ(ctx, 64), CQ(ctx, 64)
    p = Posting(env, RC, INIT, scq=scq, rcq=rcq, sq_sig_all=0)
    qp = p.qp
    qp.post_recv([RecvWR(wr_id=101), RecvWR(wr_id=102)])
    drive_from = full_attr(ctx, RTR, INIT)
    from .verbs_helpers import TABLE, bits
    qp.modify(drive_from, bits(TABLE[RC][(INIT, RTR)][0]))
    qp.post_recv(RecvWR(wr_id=103))
    qp.modify(full_attr(ctx, RTS, RTR), bits(TABLE[RC][(RTR, RTS)][0]))
    qp.post_send([p.wr(wr_id=1, flags=E.IBV_SEND_SIGNALED), p.wr(wr_id=2),  # 2: unsignaled
                  p.wr(W.IBV_WR_RDMA_WRITE, wr_id=3, flags=E.IBV_SEND_SIGNALED)])
    assert scq.poll_all() == [] and rcq.poll_all() == []  # RC: waiting for ACKs
    qp.modify(full_attr(ctx, ERR, RTS), MASK_BITS["STATE"])
    s = scq.poll_all()
    assert [(w.wr_id, w.status, w.qp_num) for w in s] == [(i, FLUSH, qp.qp_num) for i in (1, 2, 3)]
    assert [w.opcode for w in s] == [E.IBV_WC_SEND, E.IBV_WC_SEND, E.IBV_WC_RDMA_WRITE]
    r = rcq.poll_all()
    assert [(w.wr_id, w.status) for w in r] == [(i, FLUSH) for i in (101, 102, 103)]
    assert len(qp.sq) == 0 and len(qp.rq) == 0
    # anything posted in ERR is flushed at once, in order
    qp.post_send([p.wr(wr_id=4), p.wr(wr_id=5)])
    qp.post_recv(RecvWR(wr_id=104))
    assert [(w.wr_id, w.status) for w in scq.poll_all()] == [(4, FLUSH), (5, FLUSH)]
    assert [(w.wr_id, w.status) for w in rcq.poll_all()] == [(104, FLUSH)]
    p.close()


def test_reset_empties_queues_without_completions(env):
    ctx = env.ctx
    p = Posting(env, RC, INIT)
    qp = p.qp
    qp.post_recv([RecvWR(wr_id=1), RecvWR(wr_id=2)])
    qp.modify(full_attr(ctx, RESET, INIT), MASK_BITS["STATE"])
    assert len(qp.rq) == 0 and env.cq.poll_all() == []
    drive(ctx, qp, SQD)
    qp.post_send(p.wr(wr_id=3))
    qp.post_recv(RecvWR(wr_id=4))
    qp.modify(full_attr(ctx, RESET, SQD), MASK_BITS["STATE"])
    assert len(qp.sq) == 0 and len(qp.rq) == 0 and env.cq.poll_all() == []
    drive(ctx, qp, ERR)  # nothing left to flush
    assert env.cq.poll_all() == []
    p.close()


def test_reset_does_not_purge_the_cq(env):
    """As rxe: completions already in the CQ stay there when their QP is reset."""
    ctx = env.ctx
    p = Posting(env, RC, INIT)
    p.qp.post_recv([RecvWR(wr_id=1), RecvWR(wr_id=2)])
    p.qp.modify(full_attr(ctx, ERR, INIT), MASK_BITS["STATE"])
    p.qp.modify(full_attr(ctx, RESET, ERR), MASK_BITS["STATE"])
    assert [(w.wr_id, w.status) for w in env.cq.poll_all()] == [(1, FLUSH), (2, FLUSH)]
    p.close()


@pytest.mark.parametrize("sig_all", [0, 1])
def test_signaled_is_recorded_on_the_wqe(env, sig_all):
    p = Posting(env, RC, SQD, sq_sig_all=sig_all)
    p.qp.post_send([p.wr(wr_id=1, flags=E.IBV_SEND_SIGNALED), p.wr(wr_id=2, flags=0),
                    p.wr(wr_id=3, flags=E.IBV_SEND_SOLICITED)])
    assert [w.signaled for w in p.qp.sq] == [True, bool(sig_all), bool(sig_all)]
    p.close()


def test_uc_send_with_inv_is_accepted_at_post_time(env):
    p = Posting(env, UC, SQD)
    p.qp.post_send(p.wr(W.IBV_WR_SEND_WITH_INV, wr_id=9))
    assert p.qp.sq[-1].wr_id == 9
    p.close()


def test_wrs_before_a_failing_one_are_processed(env):
    """The WRs posted before the bad one are really posted: flushed at once in ERR, started
    by the data path in RTS (not left waiting for the next post)."""
    err = Posting(env, RC, ERR, cap=QPCap(max_send_wr=4, max_recv_wr=4))
    with pytest.raises(PyverbsRDMAError):
        err.qp.post_send([err.wr(wr_id=1), err.wr(W.IBV_WR_TSO, wr_id=2)])
    with pytest.raises(PyverbsRDMAError):
        err.qp.post_recv([RecvWR(wr_id=3), RecvWR(wr_id=4, sg=[SGE(0, 1, 0)] * 9)])
    assert [(w.wr_id, w.status) for w in env.cq.poll_all()] == [(1, FLUSH), (3, FLUSH)]
    assert len(err.qp.sq) == 0 and len(err.qp.rq) == 0
    ud = Posting(env, UD, RTS)
    with pytest.raises(PyverbsRDMAError):
        ud.qp.post_send([ud.wr(wr_id=5), ud.wr(W.IBV_WR_RDMA_WRITE, wr_id=6)])
    assert [(w.wr_id, w.status) for w in env.cq.poll_all()] == [(5, E.IBV_WC_SUCCESS)]
    err.close(), ud.close()


@pytest.mark.parametrize("qpt", [UC, UD])
def test_sqd_starts_no_new_message_after_earlier_traffic(env, qpt):
    p = Posting(env, qpt, RTS)
    p.qp.post_send(p.wr(wr_id=1))  # sent and completed in RTS
    assert [w.wr_id for w in env.cq.poll_all()] == [1]
    p.qp.modify(full_attr(env.ctx, SQD, RTS), MASK_BITS["STATE"])
    p.qp.post_send(p.wr(wr_id=2))
    assert env.cq.poll_all() == [] and [w.wr_id for w in p.qp.sq] == [2]
    p.close()


def test_type2_window_bind_through_a_work_request(env):
    ctx = env.ctx
    p = Posting(env, RC, RTS)
    mw = MW(env.pd, E.IBV_MW_TYPE_2)
    old = mw.rkey
    wr = SendWR(wr_id=42, opcode=W.IBV_WR_BIND_MW, send_flags=E.IBV_SEND_SIGNALED)
    wr.set_bind_wr(mw, MWBindInfo(p.mr, p.mr.buf + 128, 256, RR))
    p.qp.post_send(wr)
    assert [(w.wr_id, w.status, w.opcode) for w in env.cq.poll_all()] == \
        [(42, E.IBV_WC_SUCCESS, E.IBV_WC_BIND_MW)]
    new = mw.rkey
    assert new >> 8 == old >> 8 and new & 0xFF == (old + 1) & 0xFF  # ibv_inc_rkey
    keys = ctx.device.keys
    assert len(keys.resolve(new, env.pd, p.mr.buf + 128, 256, int(RR), remote=True,
                            qp=p.qp.engine)) == 256
    with pytest.raises(AccessError):
        keys.resolve(old, env.pd, p.mr.buf + 128, 8, int(RR), remote=True, qp=p.qp.engine)
    with pytest.raises(AccessError):  # outside the window, inside the MR
        keys.resolve(new, env.pd, p.mr.buf + 120, 16, int(RR), remote=True, qp=p.qp.engine)
    p.close()


def test_last_wqe_reached_for_a_qp_with_an_srq(env):
    """A QP on an SRQ entering ERR raises IBV_EVENT_QP_LAST_WQE_REACHED (once per ERR), also
    after the QP was reset and reused."""
    ctx = env.ctx
    srq = SRQ(env.pd, SrqInitAttr(SrqAttr(max_wr=8)))
    qp = env.qp(RC, srq=srq)
    for _ in range(2):
        drive(ctx, qp, ERR)
        ev = ctx.get_async_event(block=False)
        assert ev is not None and ev.event_type == E.IBV_EVENT_QP_LAST_WQE_REACHED
        assert ev.element is qp
        qp.modify(full_attr(ctx, ERR, ERR), MASK_BITS["STATE"])  # ERR->ERR: no second event
        assert ctx.get_async_event(block=False) is None
        qp.modify(full_attr(ctx, RESET, ERR), MASK_BITS["STATE"])
    qp.close()
    srq.close()


def test_every_kind_of_object_is_counted_against_its_device_limit(dev):
    """rxe's pools: PD, CQ, SRQ, QP, MR, MW and AH each stop at the device's max_<kind>
    with ENOMEM, and a destroyed object frees its slot."""
    import dataclasses
    old = dev.limits
    with Context(name=DEV_NAME) as c:
        e = Env(c)
        makers = {"pd": lambda: PD(c), "cq": lambda: CQ(c, 4), "mr": lambda: MR(e.pd, 16, LW),
                  "mw": lambda: MW(e.pd, 2), "srq": lambda: SRQ(e.pd, SrqInitAttr()),
                  "qp": lambda: e.qp(RC), "ah": lambda: AH(e.pd, attr=loopback_av(c))}
        try:
            for kind, make in makers.items():
                dev.limits = dataclasses.replace(old, **{f"max_{kind}": dev.in_use[kind] + 1})
                first = make()
                raises(errno.ENOMEM, make)
                first.close()
                make().close()  # the slot was given back
        finally:
            dev.limits = old


def test_unknown_keyword_arguments_are_refused_not_swallowed(env):
    """A misspelt keyword (``qp_atr=``) must not be silently ignored."""
    ctx = env.ctx
    with pytest.raises(TypeError, match="qp_atr"):
        QP(env.pd, QPInitAttr(qp_type=RC, scq=env.cq, rcq=env.cq), qp_atr=None)
    with pytest.raises(TypeError, match="atr"):
        AH(env.pd, atr=loopback_av(ctx))
    with pytest.raises(TypeError, match="nme"):
        Context(nme=DEV_NAME)
