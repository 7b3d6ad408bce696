"""Receiving in place (softrdma.wire.iov, docs/wire.md "Zero copy"): with zero copy on, a
received packet is a view of the transport's reusable receive buffer, so its payload's one
copy is the responder's (or completer's) placement into the MR, never a copy into ``bytes``
first. These tests hold the view to what that must not change: a packet whose ICRC is bad is
dropped and counted before any byte of it moves; an rkey revoked in the middle of a
multi-packet WRITE stops the placement at the packet where it was revoked (the rest is
NAKed, nothing lands outside what the key allowed while it was valid); and nothing that
keeps a packet past the call that delivered it (a request held behind a READ's response,
a UD receive, the capture) sees the buffer's next datagram.

Real UDP sockets on 127.0.1.x, devices driven by hand (``attach_udp(thread=False)``; the
receive budget of ``UdpTransport.receive_ready`` counts datagrams, so a test can stop a
message half-way), and the in-memory receive calls where a test needs one buffer reused
on purpose.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest

from softrdma.enums import (
    IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_MW_BIND, IBV_ACCESS_REMOTE_WRITE, IBV_MW_TYPE_2,
    IBV_SEND_SIGNALED, IBV_WC_REM_ACCESS_ERR, IBV_WC_SUCCESS, IBV_WR_BIND_MW,
    IBV_WR_LOCAL_INV, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE, IBV_WR_SEND, ibv_mtu,
)
from softrdma.harness.sim import SimNetwork
from softrdma.harness.testing import Endpoint, connect, connected_pair
from softrdma.qp.responder import READ_RESPONSE_BATCH
from softrdma.verbs_api import MR, MW, Context, MWBindInfo, QPCap, SendWR
from softrdma.wire.frames import decode_frame
from softrdma.wire.pcap import read_pcap

MTU = 4096
CAP = QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=1, max_recv_sge=1)
SENTINEL = 0xEE


def _pattern(n: int, seed: int) -> bytes:
    return bytes((i * 5 + seed * 17 + (i >> 10)) & 0xFF for i in range(n))


def _drive(devs: list, until: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < end, "timed out"
        for d in devs:
            d.poll(0.002)


def _arrived(dev: Any, n: int = 1, timeout: float = 5.0) -> None:
    """Wait until at least ``n`` datagrams wait in ``dev``'s receive socket (read none)."""
    import socket
    s = dev.udp.raw or dev.udp.sock
    end = time.monotonic() + timeout
    while True:
        try:
            got = len(s.recv(1 << 20, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except BlockingIOError:
            got = 0
        if got and n <= 1:
            return
        if n > 1:  # packets cannot be counted by peeking: give them time to land
            time.sleep(0.05)
            return
        assert time.monotonic() < end, "nothing arrived"
        time.sleep(0.001)


def _pair(udp_devices, monkeypatch, tag: str, n: int, *, raw: bool = False, mtu: int = 4096,
          timeout: int = 18, zc: str = "1") -> tuple[Any, Any, Endpoint, Endpoint]:
    """Two manual devices, one packet per datagram (no GSO at the sender, no GRO at the
    receiver), zero copy on (``zc``="0": off, the copying path, which must behave the
    same)."""
    monkeypatch.setenv("SOFTRDMA_ZEROCOPY", zc)
    monkeypatch.setenv("SOFTRDMA_GSO", "0")
    monkeypatch.setenv("SOFTRDMA_GRO", "0")
    da = udp_devices(f"127.0.1.{n}", f"{tag}-a", thread=False)
    db = udp_devices(f"127.0.1.{n + 1}", f"{tag}-b", thread=False, raw_rx=raw)
    assert db.zero_copy == db.udp.zero_copy == (zc == "1")
    a = Endpoint(Context(name=da.name), "RC", 1 << 18, CAP, 256)
    b = Endpoint(Context(name=db.name), "RC", 1 << 18, CAP, 256)
    path = {4096: ibv_mtu.IBV_MTU_4096, 1024: ibv_mtu.IBV_MTU_1024}[mtu]
    connect(a, b, 10, 20, path_mtu=path, timeout=timeout)
    connect(b, a, 20, 10, path_mtu=path, timeout=timeout)
    return da, db, a, b


@pytest.mark.parametrize("zc", ["1", "0"], ids=["in-place", "copying"])
@pytest.mark.parametrize("revoke", ["dereg_mr", "invalidate_mw"])
def test_an_rkey_revoked_mid_write_stops_placement_there(udp_devices, monkeypatch, revoke, zc):
    """Eight packets of one WRITE arrive as views; after the third, the target MR is
    deregistered (or the type 2 window the WRITE goes through is invalidated by a
    LOCAL_INV). The fourth is NAKed (remote access error, the requester completes with
    REM_ACCESS_ERR), nothing after it is placed, and the bytes around the permitted range
    (the window's, or the MR's) are never touched."""
    da, db, a, b = _pair(udp_devices, monkeypatch, f"rx-rk{revoke[0]}{zc}",
                         (31 if revoke == "dereg_mr" else 33) + 10 * int(zc == "0"), zc=zc)
    guard = 4096
    size = 8 * MTU
    mem = bytearray([SENTINEL]) * (guard + size + guard)
    mr = MR(b.pd, len(mem), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
            IBV_ACCESS_MW_BIND, buffer=mem)
    if revoke == "invalidate_mw":
        mw = MW(b.pd, IBV_MW_TYPE_2)
        bind = SendWR(wr_id=1, opcode=IBV_WR_BIND_MW, send_flags=IBV_SEND_SIGNALED)
        bind.set_bind_wr(mw, MWBindInfo(mr, mr.buf + guard, size, IBV_ACCESS_REMOTE_WRITE))
        b.qp.post_send(bind)
        _drive([db], lambda: len(b.cq) >= 1)
        assert [w.status for w in b.cq.poll_all()] == [IBV_WC_SUCCESS]
        rkey = mw.rkey
    else:
        rkey = mr.rkey
    data = _pattern(size, 7)
    a.mr.write(data, size, 0)
    wr = SendWR(wr_id=5, opcode=IBV_WR_RDMA_WRITE, sg=[a.sge(0, size)],
                send_flags=IBV_SEND_SIGNALED)
    wr.remote_addr, wr.rkey = mr.buf + guard, rkey
    a.qp.post_send(wr)
    _arrived(db, 8)
    assert db.udp.receive_ready(3) == 3  # FIRST and two MIDDLEs, placed
    assert bytes(mem[guard:guard + 3 * MTU]) == data[:3 * MTU]
    if revoke == "dereg_mr":
        mr.close()
    else:
        inv = SendWR(wr_id=2, opcode=IBV_WR_LOCAL_INV, send_flags=IBV_SEND_SIGNALED)
        inv.invalidate_rkey = rkey
        b.qp.post_send(inv)
        assert [w.status for w in b.cq.poll_all()] == [IBV_WC_SUCCESS]
    _drive([da, db], lambda: len(a.cq) >= 1)
    assert [w.status for w in a.cq.poll_all()] == [IBV_WC_REM_ACCESS_ERR]
    assert bytes(mem[guard:guard + 3 * MTU]) == data[:3 * MTU]
    assert set(mem[guard + 3 * MTU:]) == {SENTINEL}  # nothing after the revocation
    assert set(mem[:guard]) == {SENTINEL}


@pytest.mark.parametrize("zc", ["1", "0"], ids=["in-place", "copying"])
def test_a_bad_icrc_received_in_place_is_dropped_before_any_byte_moves(udp_devices,
                                                                       monkeypatch, zc):
    """A WRITE ONLY whose payload was changed on the way (its ICRC left as it was) reaches
    a receiver that checks ICRCs (a raw socket: the real IPv4 ID), as a view of the receive
    buffer: it is dropped and counted (icrc_err, drop reason bad_icrc) and the MR is as
    before; the requester's retransmission then lands."""
    da, db, a, b = _pair(udp_devices, monkeypatch, f"rx-icrc{zc}", 35 + 10 * int(zc == "0"),
                         raw=True, timeout=10, zc=zc)
    assert db.verify_icrc
    n = 3000
    b.mr.write(bytes([SENTINEL]) * n, n, 0)
    data = _pattern(n, 3)
    a.mr.write(data, n, 0)
    da.faults.tx.corrupt("RC_RDMA_WRITE_ONLY", field="payload", fix_icrc=False)
    a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, n), wr_id=1, remote_offset=0)
    _arrived(db)
    db.udp.receive_ready(1)
    assert db.counters.icrc_err == 1 and db.counters.drops.get("bad_icrc") == 1
    assert set(b.mr.read(n, 0)) == {SENTINEL}
    _drive([da, db], lambda: len(a.cq) >= 1)  # the retransmit timer resends it, intact
    assert [w.status for w in a.cq.poll_all()] == [IBV_WC_SUCCESS]
    assert b.mr.read(n, 0) == data and db.counters.icrc_err == 1


def test_a_bad_icrc_in_a_train_given_as_views_is_dropped(monkeypatch):
    """The train path (receive_train, the responder's take_middles) given views of one
    buffer, as a GRO read gives them, with one MIDDLE's payload byte flipped in the buffer:
    the packets before it are placed, it is dropped and counted, and nothing of it or after
    it is placed (the next ones are out of sequence)."""
    monkeypatch.setenv("SOFTRDMA_ZEROCOPY", "1")
    net = SimNetwork(seed=2)
    a, b = connected_pair(net, mtu=65536, a_attrs=dict(path_mtu=ibv_mtu.IBV_MTU_4096),
                          b_attrs=dict(path_mtu=ibv_mtu.IBV_MTU_4096))
    da, db = a.device, b.device
    sent: list[bytes] = []
    da.transmit = lambda data, dst, sport, tos=0: sent.append((bytes(data), sport))
    size = 8 * MTU
    data = _pattern(size, 9)
    a.mr.write(data, size, 0)
    b.mr.write(bytes([SENTINEL]) * size, size, 0)
    a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, size), wr_id=1, remote_offset=0)
    assert len(sent) == 8
    first, middles = sent[0], sent[1:7]
    sport = first[1]
    db.receive(first[0], da.ip_packed, db.ip_packed, sport=sport, verify_icrc=True)
    buf = bytearray(1 << 16)  # one reused receive buffer, as UdpTransport's
    seg = len(middles[0][0])
    for k, (p, _) in enumerate(middles):
        buf[k * seg:(k + 1) * seg] = p
    buf[3 * seg + 100] ^= 0x01  # the fourth MIDDLE's payload (PSN +4): a line error
    mv = memoryview(buf)
    db.receive_train([mv[k * seg:(k + 1) * seg] for k in range(6)], da.ip_packed,
                     db.ip_packed, sport=sport, verify_icrc=True)
    assert db.counters.icrc_err == 1
    placed = 4 * MTU  # the FIRST and three MIDDLEs
    assert b.mr.read(placed, 0) == data[:placed]
    assert set(b.mr.read(size - placed, placed)) == {SENTINEL}
    buf[:] = bytes(len(buf))  # the buffer reused: nothing kept a view of it
    assert b.mr.read(placed, 0) == data[:placed]


@pytest.mark.parametrize("zc", ["1", "0"], ids=["in-place", "copying"])
def test_requests_held_behind_a_read_keep_their_own_bytes(udp_devices, monkeypatch, zc):
    """A READ longer than one responder pass (READ_RESPONSE_BATCH packets) is answered in
    batches; WRITEs that arrive meanwhile are held (rxe's req_pkts) and executed after it.
    They arrive one per datagram into the same receive buffer, as views: each held one
    must carry its own bytes when it finally executes, not the next datagram's."""
    da, db, a, b = _pair(udp_devices, monkeypatch, f"rx-held{zc}", 37 + 10 * int(zc == "0"),
                         mtu=1024, zc=zc)
    read_len = (READ_RESPONSE_BATCH + 4) * 1024
    b.mr.write(_pattern(read_len, 1), read_len, 0)
    writes = [_pattern(1000, 10 + k) for k in range(3)]
    for k, w in enumerate(writes):
        a.mr.write(w, len(w), 200_000 + k * 1024)
    a.post_send(IBV_WR_RDMA_READ, a.sge(0, read_len), wr_id=1, remote_offset=0)
    for k, w in enumerate(writes):
        a.post_send(IBV_WR_RDMA_WRITE, a.sge(200_000 + k * 1024, len(w)), wr_id=2 + k,
                    remote_offset=150_000 + k * 1024)
    _arrived(db, 4)
    held_before = db.counters.drops.get("request_queue_full", 0)
    assert db.udp.receive_ready(4) == 4  # the READ (a first batch) and the three WRITEs
    assert len(db.qps[b.qp.qp_num].resp.held) == 3  # held, each a packet of its own
    _drive([da, db], lambda: len(a.cq) >= 4)
    assert [w.status for w in a.cq.poll_all()] == [IBV_WC_SUCCESS] * 4
    assert a.mr.read(read_len, 0) == _pattern(read_len, 1)
    for k, w in enumerate(writes):
        assert b.mr.read(len(w), 150_000 + k * 1024) == w
    assert db.counters.drops.get("request_queue_full", 0) == held_before


def test_ud_receives_and_the_capture_keep_their_own_bytes(udp_devices, monkeypatch,
                                                           tmp_path):
    """UD SENDs of different contents arrive one after the other into the same receive
    buffer as views: each receive buffer gets its own message, and the receiver's capture
    has each packet as it arrived (not the buffer's later contents)."""
    monkeypatch.setenv("SOFTRDMA_ZEROCOPY", "1")
    da = udp_devices("127.0.1.39", "rx-ud-a", thread=False)
    db = udp_devices("127.0.1.40", "rx-ud-b", thread=False,
                     capture=str(tmp_path / "ud-b.pcap"))
    cap = QPCap(max_send_wr=16, max_recv_wr=16, max_send_sge=1, max_recv_sge=1)
    a = Endpoint(Context(name=da.name), "UD", 1 << 16, cap, 64)
    b = Endpoint(Context(name=db.name), "UD", 1 << 16, cap, 64)
    connect(a, b, 1, 1)
    connect(b, a, 1, 1)
    msgs = [_pattern(900, 30 + k) for k in range(4)]
    for k in range(4):
        b.post_recv(b.sge(k * 2048, 2048), wr_id=k)
    for k, m in enumerate(msgs):
        a.mr.write(m, len(m), k * 1024)
        a.post_send(IBV_WR_SEND, a.sge(k * 1024, len(m)), wr_id=10 + k)
    _drive([da, db], lambda: len(b.cq) >= 4)
    wcs = sorted(b.cq.poll_all(), key=lambda w: w.wr_id)
    assert [(w.status, w.byte_len) for w in wcs] == [(IBV_WC_SUCCESS, 940)] * 4
    for k, m in enumerate(msgs):
        assert b.mr.read(900, k * 2048 + 40) == m  # after the 40-byte GRH area
    got = [bytes(decode_frame(r.data).payload) for r in read_pcap(tmp_path / "ud-b.pcap")]
    sends = [p for p in got if p[0] == 0x64]  # UD SEND ONLY
    assert [p[-4 - 900:-4] for p in sends] == msgs
