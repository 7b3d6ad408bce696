"""Packet trains (softrdma.wire.trains, UDP GSO/GRO in softrdma.soft.udp).

The sans-IO rules are checked against their definitions (the ICRC of a packet with IP ID
k computed from scratch; the kernel's limits), the IPv4 ID rule against a real kernel
cutting a real train, and the live transport both ways (trains on, trains off, a kernel
that refuses them, raw receive) with the data checked end to end. The data-path property
tests run through trains too (``link_mode`` in tests/test_datapath_properties.py and
tests/test_datapath_errors.py).
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from softrdma.enums import IBV_WR_RDMA_WRITE, IBV_WR_SEND, ibv_mtu
from softrdma.harness.testing import Endpoint, connect
from softrdma.verbs_api import QPCap, Context
from softrdma.wire.icrc import icrc_from_ip_packet, icrc_ipv4, icrc_ipv6
from softrdma.wire.opcodes import Opcode as O
from softrdma.wire.packet import build, parse
from softrdma.wire.trains import (
    MAX_SEGMENTS, MAX_TRAIN_BYTES, coalesce, ip_id_delta, split, split_unsized, train_iov,
)

from .conftest import IN_CI, require_tool, wait_until

SRC, DST, SPORT = bytes([127, 0, 0, 1]), bytes([127, 0, 0, 2]), 0xC0DE


def _pkt(op: int, psn: int, n: int, qpn: int = 0x123456, **kw) -> bytes:
    b = build(op, psn=psn, dest_qp=qpn, payload=bytes((psn + i) & 0xFF for i in range(n)), **kw)
    c = icrc_ipv4(b, SRC, DST, SPORT)
    b[-4:] = c.to_bytes(4, "little")
    return bytes(b)


# -- the ICRC for IP ID k --------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(body=st.binary(min_size=16, max_size=4200), ip_id=st.integers(0, 0xFFFF))
def test_ip_id_delta_moves_an_icrc_to_another_ip_id(body, ip_id):
    """The XOR of the delta gives exactly the ICRC computed from scratch for that IP ID."""
    at0 = icrc_ipv4(body, SRC, DST, SPORT, ip_id=0)
    assert at0 ^ ip_id_delta(ip_id, len(body)) == icrc_ipv4(body, SRC, DST, SPORT, ip_id=ip_id)


def test_train_iov_gives_each_segment_the_icrc_of_its_ip_id():
    pkts = [_pkt(O.RC_SEND_MIDDLE, p, 1024) for p in range(5)]
    iov = train_iov(pkts, ipv4=True)
    wire = b"".join(bytes(x) for x in iov)
    assert len(wire) == 5 * len(pkts[0])
    for k in range(5):
        seg = wire[k * len(pkts[0]):(k + 1) * len(pkts[0])]
        assert seg[:-4] == pkts[k][:-4]  # only the ICRC moves
        assert int.from_bytes(seg[-4:], "little") == icrc_ipv4(seg, SRC, DST, SPORT, ip_id=k)
    assert train_iov(pkts, ipv4=False) == pkts  # IPv6 has no IP ID


def test_a_wrong_icrc_stays_wrong_by_the_same_amount():
    """Fault injection corrupts ICRCs on purpose: the move keeps them exactly as wrong."""
    good = _pkt(O.RC_SEND_MIDDLE, 1, 256)
    bad = good[:-4] + bytes(b ^ 0x5A for b in good[-4:])
    seg = b"".join(bytes(x) for x in train_iov([good, bad], ipv4=True))[len(good):]
    right = icrc_ipv4(seg, SRC, DST, SPORT, ip_id=1)
    assert int.from_bytes(seg[-4:], "little") ^ right == int.from_bytes(b"\x5a" * 4, "little")


# -- grouping --------------------------------------------------------------------------------

def _q(sizes, dst=DST, sport=SPORT):
    return [(bytes([i & 0xFF]) * n, dst, sport) for i, n in enumerate(sizes)]


def test_coalesce_keeps_order_and_the_gso_rules():
    q = _q([4128] + [4112] * 14 + [1000, 4112, 4112]) + _q([20, 20], sport=SPORT + 1) + \
        _q([20], dst=SRC)
    trains = list(coalesce(q))
    assert [(len(p), size) for _, _, size, p in trains] == [
        (1, 4128),  # a WRITE FIRST (with its RETH) leaves alone ...
        (15, 4112),  # ... so MIDDLEs and the shorter LAST go together
        (2, 4112),
        (2, 20),  # another source port: another train
        (1, 20)]  # another destination
    flat = [p for _, _, _, ps in trains for p in ps]
    assert flat == [d for d, _, _ in q]  # nothing reordered, lost or repeated
    for dst, sport, size, ps in trains:
        assert all(len(p) == size for p in ps[:-1]) and len(ps[-1]) <= size
        assert sum(map(len, ps)) <= MAX_TRAIN_BYTES and len(ps) <= MAX_SEGMENTS


def test_coalesce_limits_a_train_to_one_udp_datagram():
    trains = list(coalesce(_q([4112] * 40)))
    assert [len(p) for *_, p in trains] == [15, 15, 10]  # 16 x 4112 > 65507
    trains = list(coalesce(_q([100] * 150)))
    assert [len(p) for *_, p in trains] == [MAX_SEGMENTS, MAX_SEGMENTS, 150 - 2 * MAX_SEGMENTS]


def test_split_and_split_unsized():
    pkts = [_pkt(O.RC_RDMA_WRITE_MIDDLE, p, 1024) for p in range(3)] + \
        [_pkt(O.RC_RDMA_WRITE_LAST, 3, 100)]
    whole = b"".join(pkts)
    assert [bytes(x) for x in split(memoryview(whole), len(whole), len(pkts[0]))] == pkts
    assert split_unsized(whole) == pkts
    acks = [_pkt(O.RC_ACKNOWLEDGE, p, 0, syndrome=0x1F, msn=p) for p in range(4)]
    assert split_unsized(b"".join(acks)) == acks
    assert split_unsized(pkts[0]) == [pkts[0]]


# -- a real kernel cuts a real train --------------------------------------------------------

NETNS = "softrdma-trains"


@pytest.fixture
def netns():
    """A network namespace whose loopback cannot carry trains (tx-udp-segmentation off), so
    the kernel cuts them in software before the packet socket sees them."""
    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail("CI=true and not root: a network namespace needs root")
        pytest.skip("needs root for a network namespace")
    require_tool("ethtool")
    subprocess.run(["ip", "netns", "del", NETNS], capture_output=True)
    subprocess.run(["ip", "netns", "add", NETNS], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", NETNS, "ip", "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "netns", "exec", NETNS, "ethtool", "-K", "lo",
                        "tx-udp-segmentation", "off"], check=True, capture_output=True)
        yield NETNS
    finally:
        subprocess.run(["ip", "netns", "del", NETNS], capture_output=True)


_CUT = r'''
import socket, struct, sys
from softrdma.wire.trains import train_iov
pkts = [bytes.fromhex(h) for h in sys.argv[1:]]
rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); rx.bind(("127.0.0.2", 4791))
cap = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
cap.bind(("lo", 0)); cap.settimeout(2)
tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
tx.setsockopt(socket.IPPROTO_IP, 10, 2)  # IP_PMTUDISC_DO: DF, as softrdma sends
tx.bind(("127.0.0.1", 0xC0DE))
tx.sendmsg(train_iov(pkts, True), [(17, 103, struct.pack("=H", len(pkts[0])))], 0,
           ("127.0.0.2", 4791))
for _ in pkts:
    print(cap.recv(70000)[14:].hex())   # the IP packets, after the Ethernet header
'''


def test_the_kernel_numbers_train_segments_as_the_icrc_assumes(netns):
    """A train of five MIDDLEs and a LAST cut by the kernel: six IP packets with IDs 0..5,
    each a whole RoCE packet whose ICRC checks out from its own IP header."""
    pkts = [_pkt(O.RC_SEND_MIDDLE, p, 512) for p in range(5)] + [_pkt(O.RC_SEND_LAST, 5, 100)]
    r = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", _CUT,
                        *[p.hex() for p in pkts]], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    ips = [bytes.fromhex(h) for h in r.stdout.split()]
    assert len(ips) == len(pkts)
    for k, (ip, sent) in enumerate(zip(ips, pkts)):
        assert struct.unpack_from("!H", ip, 4)[0] == k  # the IP ID
        assert ip[28:-4] == sent[:-4]  # the RoCE packet, intact
        assert icrc_from_ip_packet(ip) == int.from_bytes(ip[-4:], "little")


# -- the live transport -------------------------------------------------------------------

CAP = QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=1, max_recv_sge=1)
SIZE = 65536 + 3000  # 17 packets at 4096: FIRST, 15 MIDDLEs, LAST


def _transfer(da, db, opcode: int, rounds: int = 3) -> None:
    """``rounds`` messages of SIZE bytes from da to db, each checked byte for byte."""
    a = Endpoint(Context(name=da.name), "RC", 2 * SIZE, CAP, 256)
    b = Endpoint(Context(name=db.name), "RC", 2 * SIZE, CAP, 256)
    mtu = dict(path_mtu=ibv_mtu.IBV_MTU_4096, timeout=18)
    connect(a, b, 100, 0xFFFFF8, **mtu)  # the receiver's PSNs wrap inside a train
    connect(b, a, 0xFFFFF8, 100, **mtu)
    for r in range(rounds):
        data = bytes((i * 13 + r) & 0xFF for i in range(SIZE))
        a.mr.write(data, SIZE, 0)
        if opcode == IBV_WR_SEND:
            b.post_recv(b.sge(SIZE, SIZE), wr_id=r)
        a.post_send(opcode, a.sge(0, SIZE), wr_id=r,
                    remote_offset=SIZE if opcode == IBV_WR_RDMA_WRITE else None)
        assert wait_until(lambda: len(a.cq) >= 1)
        assert [w.status for w in a.cq.poll_all()] == [0]
        if opcode == IBV_WR_SEND:
            assert wait_until(lambda: len(b.cq) >= 1)
            wcs = b.cq.poll_all()
            assert [(w.status, w.byte_len) for w in wcs] == [(0, SIZE)]
        assert b.mr.read(SIZE, SIZE) == data
    a.close(), b.close()


@pytest.mark.parametrize("opcode", [IBV_WR_RDMA_WRITE, IBV_WR_SEND], ids=["write", "send"])
@pytest.mark.parametrize("gso, gro", [("1", "1"), ("1", "0"), ("0", "1"), ("0", "0")],
                         ids=["trains", "gso-only", "gro-only", "packets"])
def test_live_transfer_with_and_without_trains(udp_devices, monkeypatch, opcode, gso, gro):
    monkeypatch.setenv("SOFTRDMA_GSO", gso)
    monkeypatch.setenv("SOFTRDMA_GRO", gro)
    da = udp_devices("127.0.17.1", "tr-a")
    db = udp_devices("127.0.17.2", "tr-b")
    assert (da.udp.gso, db.udp.gro) == (gso == "1", gro == "1")
    _transfer(da, db, opcode)
    sent = da.counters.gso_trains
    assert (sent > 0) == (gso == "1")
    # a train reaches a GRO socket whole, else the kernel cuts it on the way in
    assert (db.counters.gro_trains > 0) == (gso == "1" and gro == "1")
    assert db.counters.dropped_pkts == 0 and da.counters.dropped_pkts == 0


class _RefusingSocket:
    """A send socket on a kernel without UDP GSO: sendmsg with UDP_SEGMENT fails."""

    def __init__(self, real: socket.socket) -> None:
        self.real = real
        self.refused = 0

    def sendmsg(self, buffers, cmsgs=(), *a, **k):
        if not any(c[:2] == (17, 103) for c in cmsgs):  # no UDP_SEGMENT: an ordinary send
            return self.real.sendmsg(buffers, cmsgs, *a, **k)
        self.refused += 1
        raise OSError(errno.EIO, "no GSO here")

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_a_kernel_that_refuses_trains_gets_packets(udp_devices, monkeypatch):
    monkeypatch.setenv("SOFTRDMA_GSO", "1")
    da = udp_devices("127.0.17.3", "tr-c")
    db = udp_devices("127.0.17.4", "tr-d")
    t = da.udp
    real_for = t._socket_for
    wrapped: dict[int, _RefusingSocket] = {}

    def socket_for(sport):
        s = real_for(sport)
        return None if s is None else wrapped.setdefault(id(s), _RefusingSocket(s))

    monkeypatch.setattr(t, "_socket_for", socket_for)
    _transfer(da, db, IBV_WR_RDMA_WRITE, rounds=2)
    assert sum(w.refused for w in wrapped.values()) == 1  # tried once, then packet by packet
    assert da.counters.gso_fallback == 1 and not t.gso and da.counters.gso_trains == 0
    assert da.counters.dropped_pkts == 0


def test_raw_receive_checks_each_packet_of_a_train(udp_devices, monkeypatch):
    """A raw socket sees a train that crossed loopback whole, without its segment size: it
    is cut (split_unsized) and every packet's ICRC is verified for its own IP ID."""
    monkeypatch.setenv("SOFTRDMA_GSO", "1")
    da = udp_devices("127.0.17.5", "tr-e")
    db = udp_devices("127.0.17.6", "tr-f", raw_rx=True)
    _transfer(da, db, IBV_WR_RDMA_WRITE, rounds=2)
    assert da.counters.gso_trains > 0
    assert db.counters.icrc_err == 0 and db.counters.dropped_pkts == 0
    assert db.counters.icrc_unchecked == 0 and db.counters.rcvd_pkts >= 2 * 17


def test_a_train_from_rxe_shaped_packets_reads_as_packets(udp_devices):
    """ICRCs for IP ID 0 on every packet (what a GRO'd train from a DF sender such as rxe
    carries) are not mistaken: the capture's IP IDs stay 0 where the ICRC says so."""
    from softrdma.soft.udp import _train_ip_id
    pkts = [_pkt(O.RC_SEND_MIDDLE, p, 256) for p in range(3)]
    assert [_train_ip_id(memoryview(p), SRC, DST, SPORT, k) for k, p in enumerate(pkts)] == [0, 0, 0]
    moved = b"".join(bytes(x) for x in train_iov(pkts, True))
    parts = split(memoryview(moved), len(moved), len(pkts[0]))
    assert [_train_ip_id(p, SRC, DST, SPORT, k) for k, p in enumerate(parts)] == [0, 1, 2]
    assert all(parse(bytes(p)).psn == k for k, p in enumerate(parts))


def test_ipv6_icrc_needs_no_move():
    src6, dst6 = bytes(15) + b"\x01", bytes(15) + b"\x02"
    b = build(O.RC_SEND_MIDDLE, psn=1, dest_qp=5, payload=bytes(64))
    c = icrc_ipv6(b, src6, dst6, SPORT)
    b[-4:] = c.to_bytes(4, "little")
    assert train_iov([bytes(b), bytes(b)], ipv4=False)[1] == bytes(b)


# -- when queued packets leave ----------------------------------------------------------------

def test_the_device_lock_flushes_at_its_outermost_release_only():
    from softrdma.soft.lock import DeviceLock
    lock = DeviceLock()
    flushed = []
    lock.on_release = lambda: flushed.append(lock.depth)
    with lock:
        with lock:
            pass
        assert flushed == []  # an inner release: the section is not over
    assert flushed == [1]  # called while still held, once
    assert lock.acquire(blocking=False)
    lock.release()
    assert flushed == [1, 1]


def test_what_a_datagram_provokes_leaves_before_the_next_is_read(udp_devices):
    """receive_ready flushes after each datagram: the ACK a message asks for is on its way
    before the next datagram is handled, not after the whole receive budget (a sender
    waiting on its window would stall)."""
    da = udp_devices("127.0.17.7", "tr-g", thread=False)
    db = udp_devices("127.0.17.8", "tr-h", thread=False)
    a = Endpoint(Context(name=da.name), "RC", 1 << 16, CAP, 256)
    b = Endpoint(Context(name=db.name), "RC", 1 << 16, CAP, 256)
    connect(a, b, 100, 200, timeout=18)
    connect(b, a, 200, 100, timeout=18)
    for i in range(3):  # three WRITE_ONLYs, each with AckReq, three datagrams at b
        a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, 64), wr_id=i, remote_offset=1024 * i)
    queued_at_each = []
    receive = db.receive

    def watch(*args, **kw):
        queued_at_each.append(len(db.udp._pending))
        receive(*args, **kw)

    def read():  # as the progress thread and poll_cq read: the lock held around the batch
        with db.lock:
            db.udp.receive_ready()
        return len(queued_at_each) >= 3

    db.receive = watch
    assert wait_until(read)
    db.receive = receive
    assert queued_at_each == [0, 0, 0]
    assert wait_until(lambda: (da.poll(0.01), len(a.cq))[1] >= 3)
    a.close(), b.close()


def test_the_train_shortcuts_are_taken(monkeypatch):
    """The requester's and the responder's train paths are what the train-mode data-path
    tests exercise: a 5-packet WRITE over SimNetwork(trains=True) is made by one
    _send_middles pass and its three MIDDLEs taken by one take_middles call."""
    from softrdma.harness.sim import SimNetwork
    from softrdma.harness.testing import connected_pair
    from softrdma.qp.requester import Requester
    from softrdma.qp.responder import Responder
    made, taken = [], []
    send_middles, take_middles = Requester._send_middles, Responder.take_middles

    def spy_send(self, wqe, opcode, mtu, rc):
        before = self.psn
        send_middles(self, wqe, opcode, mtu, rc)
        made.append((self.psn - before) & 0xFFFFFF)

    def spy_take(self, packets, mtu):
        n = take_middles(self, packets, mtu)
        taken.append((len(packets), n))
        return n

    monkeypatch.setattr(Requester, "_send_middles", spy_send)
    monkeypatch.setattr(Responder, "take_middles", spy_take)
    with SimNetwork(seed=1, trains=True, delay=0.0) as net:
        a, b = connected_pair(net, "RC")  # path MTU 1024
        data = bytes(range(256)) * 18  # 4608 bytes: FIRST, 3 MIDDLEs, LAST
        a.mr.write(data, len(data), 0)
        a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, len(data)), 1, remote_offset=8192)
        assert net.run_until(lambda: len(a.cq) >= 1)
        assert [w.status for w in a.cq.poll_all()] == [0]
        assert b.mr.read(len(data), 8192) == data
        a.close(), b.close()
    assert made == [3] and taken == [(3, 3)]
