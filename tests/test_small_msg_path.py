"""The small-message fast paths (SOFTRDMA_SMALL_MSG) against the general ones.

Three fast paths: ``SoftQP._post_one`` (post_send of one WR without the chain walk),
``Requester._send_only`` (one RC/UC SEND or WRITE packet without the requester loop's
general dispatch) and ``trains._joined_train`` (a train of small IPv4 packets as one buffer,
its ICRCs moved by one XOR). Each must be invisible: the same packets on the wire, byte
for byte, the same completions, and the same checks refusing a bad WR.

The wire comparison posts the same WR twice on one connected pair (simulated network),
first with the fast paths off, then on; the second packet must be the first with the next
PSN, its ICRC computed afresh here for that PSN (softrdma.wire.icrc), so both the fast
path's headers and its ICRC are checked against the general path's.
"""

from __future__ import annotations

import errno
import os

import pytest

from softrdma.enums import (
    IBV_SEND_FENCE, IBV_SEND_INLINE, IBV_SEND_SIGNALED, IBV_SEND_SOLICITED,
    IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND, IBV_WR_SEND_WITH_IMM,
)
from softrdma.errors import PyverbsRDMAError
from softrdma.harness.sim import SimNetwork
from softrdma.harness.testing import UD_QKEY
from softrdma.qp import requester
from softrdma.verbs_api import SGE, SendWR, soft_qp
from softrdma.wire import trains
from softrdma.wire.headers import BTH_PSN_MASK
from softrdma.wire.icrc import icrc_ipv4
from softrdma.wire.iov import packet_bytes
from softrdma.wire.packet import parse
from softrdma.wire.trains import ip_id_delta, train_iov

from .datapath_helpers import pair

SIGNALED, SOLICITED, INLINE, FENCE = (int(IBV_SEND_SIGNALED), int(IBV_SEND_SOLICITED),
                                      int(IBV_SEND_INLINE), int(IBV_SEND_FENCE))


def _fast(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    for mod in (requester, soft_qp, trains):
        monkeypatch.setattr(mod, "SMALL_MSG", on)


class Tap:
    """Record what a device transmits, with the source port (the ICRC covers it)."""

    def __init__(self, dev) -> None:
        self.dev = dev
        self.inner = dev.transmit
        self.sent: list[tuple[bytes, bytes, int]] = []
        dev.transmit = self._tx

    def _tx(self, data, dst, sport, *tos) -> None:
        self.sent.append((packet_bytes(data), dst, sport))
        self.inner(data, dst, sport, *tos)


def _post(a, b, opcode: int, flags: int, length: int, nsge: int, wr_id: int) -> SendWR:
    """One WR of the shape asked for: ``nsge`` SGEs of ``length`` bytes in all (0 SGEs for
    a zero-length message), to slot ``wr_id`` of the peer's MR."""
    if nsge == 0:
        sg = []
    else:
        part = length // nsge
        sizes = [part] * (nsge - 1) + [length - part * (nsge - 1)]
        sg, off = [], 4096 * wr_id
        for s in sizes:
            sg.append(a.sge(off, s))
            off += s + 8  # apart: the SGEs are not one buffer
    wr = SendWR(wr_id, opcode=opcode, sg=sg, imm_data=0x12345678 + wr_id, send_flags=flags)
    wr.set_wr_rdma(b.mr.rkey, b.mr.buf + 4096 * wr_id)
    if a.qp_type == "UD":
        wr.set_wr_ud(a.ah, b.qp.qp_num, UD_QKEY)
    a.qp.post_send(wr)
    return wr


def _run(net, a, b) -> list:
    net.run_until(lambda: False, timeout=0.05)
    return [(wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.wc_flags, wc.imm_data)
            for wc in a.cq.poll_all()] + \
           [(wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.wc_flags, wc.imm_data)
            for wc in b.cq.poll_all()]


SHAPES = [
    # (qp type, opcode, send flags, length, SGEs)
    ("RC", IBV_WR_RDMA_WRITE, SIGNALED, 64, 1),
    ("RC", IBV_WR_RDMA_WRITE, 0, 64, 1),
    ("RC", IBV_WR_RDMA_WRITE, SIGNALED, 0, 0),
    ("RC", IBV_WR_RDMA_WRITE, SIGNALED | INLINE, 48, 2),
    ("RC", IBV_WR_RDMA_WRITE, SIGNALED | SOLICITED, 64, 1),  # no SE on a plain WRITE
    ("RC", IBV_WR_RDMA_WRITE, SIGNALED | FENCE, 64, 1),
    ("RC", IBV_WR_RDMA_WRITE_WITH_IMM, SIGNALED | SOLICITED, 100, 3),
    ("RC", IBV_WR_RDMA_WRITE_WITH_IMM, SIGNALED, 0, 0),
    ("RC", IBV_WR_SEND, SIGNALED, 64, 1),
    ("RC", IBV_WR_SEND, SIGNALED | SOLICITED | INLINE, 32, 1),
    ("RC", IBV_WR_SEND, SIGNALED, 1024, 1),  # exactly the path MTU
    ("RC", IBV_WR_SEND, SIGNALED, 1025, 1),  # two packets: the general path
    ("RC", IBV_WR_SEND, SIGNALED, 600, 1),  # a zero-copy payload: the general path
    ("RC", IBV_WR_SEND_WITH_IMM, 0, 7, 1),
    ("UC", IBV_WR_RDMA_WRITE, SIGNALED, 64, 1),
    ("UC", IBV_WR_RDMA_WRITE_WITH_IMM, SIGNALED | SOLICITED, 64, 1),
    ("UC", IBV_WR_SEND, 0, 64, 2),
    ("UC", IBV_WR_SEND_WITH_IMM, SIGNALED | INLINE, 8, 1),
    ("UD", IBV_WR_SEND, SIGNALED, 64, 1),
    ("UD", IBV_WR_SEND_WITH_IMM, SIGNALED | SOLICITED, 0, 0),
]


@pytest.mark.parametrize("qpt, opcode, flags, length, nsge", SHAPES)
def test_fast_and_general_paths_put_the_same_bytes_on_the_wire(monkeypatch, qpt, opcode,
                                                                flags, length, nsge):
    """The same WR, posted with the fast paths off and then on, gives the same packets
    (only the PSN, and so the ICRC, moves on: recomputed here for the next PSN) and the
    same completions on both sides (wr_id aside)."""
    with SimNetwork() as net, pair(net, qpt) as (a, b):
        a.mr.write(os.urandom(1 << 16), 1 << 16, 0)
        for i in range(4):
            b.post_recv(b.sge(i * 4096, 2048), wr_id=100 + i)
        tap = Tap(a.device)
        wcs = []
        for on in (False, True):
            _fast(monkeypatch, on)
            tap.sent.clear()
            _post(a, b, opcode, flags, length, nsge, wr_id=1)
            got = _run(net, a, b)
            wcs.append(sorted((w[1:]) for w in got))
            reqs = [s for s in tap.sent if not parse(s[0]).info.is_response]
            if on:
                fast_pkts = reqs
            else:
                slow_pkts = reqs
        assert wcs[0] == wcs[1]
        assert len(fast_pkts) == len(slow_pkts) > 0
        step = len(slow_pkts)
        for (slow, dst, sport), (fast, dst2, sport2) in zip(slow_pkts, fast_pkts):
            assert (dst, sport) == (dst2, sport2)
            moved = bytearray(slow)
            psn = (int.from_bytes(slow[9:12], "big") + step) & BTH_PSN_MASK
            moved[9:12] = psn.to_bytes(3, "big")
            icrc = icrc_ipv4(moved, tap.dev.ip_packed, dst, sport)
            moved[-4:] = icrc.to_bytes(4, "little")
            assert bytes(moved) == fast
        if flags & SIGNALED or qpt != "RC":
            assert wcs[0], "the shape completed nothing: the comparison saw no completion"


def test_one_wr_post_checks_as_the_list_post_does(monkeypatch):
    """A bad lkey is a completion error (as rxe: checked when the data moves), on both
    paths alike; a WR over max_inline_data, an unknown send flag, more SGEs than max_send_sge
    and a wr_id over 64 bits are refused at post (EINVAL), nothing queued, by the one-WR
    post as by the general one."""
    results = []
    for on in (False, True):
        with SimNetwork() as net, pair(net, "RC") as (a, b):
            _fast(monkeypatch, on)
            wr = SendWR(7, opcode=IBV_WR_RDMA_WRITE, send_flags=SIGNALED,
                        sg=[SGE(a.mr.buf, 64, a.mr.lkey ^ 0x100)])
            wr.set_wr_rdma(b.mr.rkey, b.mr.buf)
            a.qp.post_send(wr)
            net.run_until(lambda: len(a.cq) > 0, timeout=1.0)
            results.append([(wc.wr_id, wc.status) for wc in a.cq.poll_all()])
    assert results[0] == results[1] and results[0] and results[0][0][1] != 0
    for on in (False, True):
        with SimNetwork() as net, pair(net, "RC") as (a, b):
            _fast(monkeypatch, on)
            big = SendWR(1, opcode=IBV_WR_RDMA_WRITE, send_flags=SIGNALED | INLINE,
                         sg=[a.sge(0, 65)])  # max_inline_data is 64
            big.set_wr_rdma(b.mr.rkey, b.mr.buf)
            with pytest.raises(PyverbsRDMAError) as ei:
                a.qp.post_send(big)
            assert ei.value.error_code == errno.EINVAL and ei.value.bad_wr is big
            odd = SendWR(2, opcode=IBV_WR_RDMA_WRITE, send_flags=0x100, sg=[a.sge(0, 8)])
            with pytest.raises(PyverbsRDMAError) as ei:
                a.qp.post_send(odd)
            assert ei.value.error_code == errno.EINVAL
            many = SendWR(3, opcode=IBV_WR_RDMA_WRITE, sg=[a.sge(16 * i, 8) for i in range(5)])
            many.set_wr_rdma(b.mr.rkey, b.mr.buf)  # max_send_sge is 4
            with pytest.raises(PyverbsRDMAError) as ei:
                a.qp.post_send(many)
            assert ei.value.error_code == errno.EINVAL
            wide = SendWR(1 << 64, opcode=IBV_WR_RDMA_WRITE, sg=[a.sge(0, 8)])
            wide.set_wr_rdma(b.mr.rkey, b.mr.buf)  # a wr_id over 64 bits
            with pytest.raises(PyverbsRDMAError) as ei:
                a.qp.post_send(wide)
            assert ei.value.error_code == errno.EINVAL
            assert len(a.qp.impl.engine.sq) == 0  # nothing of any was queued


@pytest.mark.parametrize("count, last", [(2, 96), (64, 96), (7, 60), (3, 512)])
def test_a_joined_train_carries_each_segment_with_the_icrc_of_its_ip_id(monkeypatch, count,
                                                                         last):
    """A train of small packets, joined, is the per-packet iov's bytes (fast path off), and
    each segment's ICRC is the one for its IP ID (computed from scratch here)."""
    src, dst, sport = bytes([10, 0, 0, 1]), bytes([10, 0, 0, 2]), 0xC000
    pkts = []
    for k in range(count):
        n = 96 if k < count - 1 else last
        if count == 3:
            n = 512
        p = bytearray(os.urandom(n))
        p[0] = 0x0A  # any BTH
        p[-4:] = icrc_ipv4(p, src, dst, sport).to_bytes(4, "little")
        pkts.append(bytes(p))
    _fast(monkeypatch, False)
    slow = b"".join(bytes(x) for x in train_iov(pkts, True))
    _fast(monkeypatch, True)
    fast_iov = train_iov(pkts, True)
    assert len(fast_iov) == 1  # joined
    assert fast_iov[0] == slow
    off = 0
    for k, p in enumerate(pkts):
        seg = fast_iov[0][off:off + len(p)]
        assert int.from_bytes(seg[-4:], "little") == icrc_ipv4(seg, src, dst, sport, ip_id=k)
        assert int.from_bytes(seg[-4:], "little") == \
            int.from_bytes(p[-4:], "little") ^ (ip_id_delta(k, len(p)) if k else 0)
        off += len(p)
    # a longer last packet is no train shape: the per-packet iov, not joined
    odd = pkts[:1] + [pkts[0] + b"\0\0\0\0"]
    assert len(train_iov(odd, True)) > 1


def test_a_coalesced_ack_retires_the_same_wqes_either_way(udp_devices, monkeypatch):
    """A post list of 40 SENDs and WRITEs (some signaled) leaves as one train over real UDP
    (127.0.4.x) and comes back as coalesced ACKs: retired in one pass
    (``Completer._retire_implied``) or one by one (off), the sender's completions are the
    same, in order, CQEs only for the signaled WRs, and its send queue is left empty."""
    from softrdma.harness.testing import Endpoint, connect
    from softrdma.qp import completer
    from softrdma.verbs_api import Context, QPCap

    from .conftest import wait_until

    cap = QPCap(max_send_wr=256, max_recv_wr=256, max_send_sge=4, max_recv_sge=4,
                max_inline_data=64)
    signaled = [i for i in range(40) if i % 7 == 0 or i == 39]
    results = []
    for k, on in enumerate((False, True)):
        monkeypatch.setattr(completer, "SMALL_MSG", on)
        retired = []
        orig = completer.Completer._retire_implied

        def spy(self, psn, orig=orig, retired=retired):
            r = orig(self, psn)
            retired.append(r)
            return r
        monkeypatch.setattr(completer.Completer, "_retire_implied", spy)
        da = udp_devices(f"127.0.4.{20 + 2 * k}", f"smp-a{k}")
        db = udp_devices(f"127.0.4.{21 + 2 * k}", f"smp-b{k}")
        a = Endpoint(Context(name=da.name), "RC", 1 << 16, cap, 256)
        b = Endpoint(Context(name=db.name), "RC", 1 << 16, cap, 256)
        connect(a, b, 100, 200)
        connect(b, a, 200, 100)
        for i in range(40):
            b.post_recv(b.sge(256 * i, 256), wr_id=1000 + i)
        wrs = []
        for i in range(40):
            op = IBV_WR_SEND if i % 3 == 0 else IBV_WR_RDMA_WRITE
            wr = SendWR(i, opcode=op, sg=[a.sge(64 * i, 64)],
                        send_flags=SIGNALED if i in signaled else 0)
            wr.set_wr_rdma(b.mr.rkey, b.mr.buf + 64 * i)
            wrs.append(wr)
        a.qp.post_send(wrs)
        got = []
        assert wait_until(lambda: got.extend(a.cq.poll_all()) or
                          (len(got) >= len(signaled) and not a.qp.impl.engine.sq))
        results.append([(wc.wr_id, wc.status, wc.opcode, wc.byte_len) for wc in got])
        assert any(retired) == on  # the one-pass retire ran (on) or was skipped (off)
        a.close()
        b.close()
    assert results[0] == results[1]
    assert [r[0] for r in results[0]] == signaled and all(r[1] == 0 for r in results[0])
