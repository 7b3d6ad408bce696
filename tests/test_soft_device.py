"""The soft device on real UDP sockets: traffic, ICRC checking, hostile input, capture,
counters and clean shutdown."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from softrdma.enums import IBV_WR_RDMA_WRITE, IBV_WR_SEND
from softrdma.soft.udp import TransportError
from softrdma.harness.testing import Endpoint, connect
from softrdma.verbs_api import Context, QPCap
from softrdma.verbs_api.device import add_device, unregister_device
from softrdma.wire.frames import decode_frame
from softrdma.wire.opcodes import Opcode
from softrdma.wire.packet import build, parse
from softrdma.wire.pcap import read_pcap

from .conftest import wait_until

_wait = functools.partial(wait_until, timeout=5.0)  # (the waits of this file)

CAP = QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=1, max_recv_sge=1)




def _pair(da, db):
    a = Endpoint(Context(name=da.name), "RC", 1 << 18, CAP, 256)
    b = Endpoint(Context(name=db.name), "RC", 1 << 18, CAP, 256)
    connect(a, b, 5, 0xFFFFFE)
    connect(b, a, 0xFFFFFE, 5)
    return a, b


def _fds():
    return len(os.listdir("/proc/self/fd"))


def test_rc_over_udp_with_progress_threads_and_clean_shutdown(udp_devices, tmp_path):
    threads0, fds0 = set(threading.enumerate()), _fds()
    pcap = tmp_path / "cap.pcap"
    da = udp_devices("127.0.0.41", "t-a", capture=str(pcap))
    db = udp_devices("127.0.0.42", "t-b")
    a, b = _pair(da, db)
    data = bytes(range(256)) * 40
    a.mr.write(data, len(data))
    b.post_recv(b.sge(0, 20000), 1)
    a.post_send(IBV_WR_SEND, a.sge(0, len(data)), 2)
    a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, len(data)), 3, remote_offset=50000)
    assert _wait(lambda: len(a.cq) >= 2 and len(b.cq) >= 1)
    assert [w.status for w in a.cq.poll_all()] == [0, 0]
    assert b.cq.poll_all()[0].byte_len == len(data)
    assert b.mr.read(len(data), 0) == data and b.mr.read(len(data), 50000) == data
    # IPv4 over a UDP socket: the IP ID is invisible, ICRCs are counted as unchecked
    assert db.counters.icrc_unchecked == db.counters.rcvd_pkts > 0
    assert da.counters.sent_pkts == db.counters.rcvd_pkts
    a.close(), b.close()
    da.detach(), db.detach()
    # every packet both ways was captured with valid framing and ICRC
    frames = [decode_frame(r.data) for r in read_pcap(pcap)]
    pkts = [parse(f.payload) for f in frames]
    assert len(pkts) == da.counters.sent_pkts + da.counters.rcvd_pkts
    assert all(f.icrc() == p.icrc for f, p in zip(frames, pkts))
    assert {f.src for f in frames} == {"127.0.0.41", "127.0.0.42"}
    # no thread and no descriptor left behind
    assert _wait(lambda: set(threading.enumerate()) <= threads0)
    assert _fds() <= fds0


def test_udp_source_ports_are_rxe_ports(udp_devices, tmp_path):
    pcap = tmp_path / "c.pcap"
    da = udp_devices("127.0.0.43", "t-c", capture=str(pcap))
    db = udp_devices("127.0.0.44", "t-d")
    a, b = _pair(da, db)
    b.post_recv(b.sge(0, 100), 1)
    a.post_send(IBV_WR_SEND, a.sge(0, 100), 2)
    assert _wait(lambda: len(a.cq) >= 1)
    from softrdma.qp.params import udp_sport_for_path
    want = udp_sport_for_path(0, a.qp.qp_num, b.qp.qp_num)
    frames = [decode_frame(r.data) for r in read_pcap(pcap)]
    assert {f.sport for f in frames} == {want}  # both directions use the path's port
    assert da.counters.sport_fallback == 0
    a.close(), b.close()


def test_ipv6_icrc_is_verified_and_corruption_is_caught(udp_devices):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    d = udp_devices("::1", "t-v6")
    a = Endpoint(Context(name=d.name), "RC", 1 << 16, CAP, 64)
    b = Endpoint(Context(name=d.name), "RC", 1 << 16, CAP, 64)
    connect(a, b, 1, 2)
    connect(b, a, 2, 1)
    b.post_recv(b.sge(0, 3000), 1)
    a.post_send(IBV_WR_SEND, a.sge(0, 3000), 2)
    assert _wait(lambda: len(a.cq) >= 1 and len(b.cq) >= 1)
    assert d.counters.icrc_err == 0 and d.counters.icrc_unchecked == 0
    # a packet whose payload was damaged in flight: counted and dropped
    raw = build(Opcode.RC_SEND_ONLY, dest_qp=b.qp.qp_num, psn=3, payload=b"x" * 16)
    from softrdma.wire.icrc import set_icrc_ipv6
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.bind(("::1", 0))
    set_icrc_ipv6(raw, socket.inet_pton(socket.AF_INET6, "::1"),
                  socket.inet_pton(socket.AF_INET6, "::1"), s.getsockname()[1])
    raw[-6] ^= 0x40
    s.sendto(bytes(raw), ("::1", 4791))
    s.close()
    assert _wait(lambda: d.counters.icrc_err == 1)
    assert d.counters.drops.get("bad_icrc") == 1
    a.close(), b.close()


def test_raw_mode_verifies_ipv4_icrc(udp_devices):
    if os.geteuid() != 0:
        pytest.skip("raw sockets need root (CAP_NET_RAW)")
    da = udp_devices("127.0.0.45", "t-raw", raw_rx=True)
    db = udp_devices("127.0.0.46", "t-raw2")
    a, b = _pair(db, da)
    b.post_recv(b.sge(0, 5000), 1)
    a.post_send(IBV_WR_SEND, a.sge(0, 5000), 2)
    assert _wait(lambda: len(b.cq) >= 1 and len(a.cq) >= 1)
    assert da.counters.icrc_unchecked == 0 and da.counters.icrc_err == 0
    assert da.counters.rcvd_pkts > 0
    a.close(), b.close()


def test_hostile_datagrams_are_counted_and_dropped(udp_devices):
    d = udp_devices("127.0.0.47", "t-host")
    ep = Endpoint(Context(name=d.name), "RC", 1 << 16, CAP, 64)
    before = bytes(ep.mr.mem)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    junk = [b"", b"\x04", bytes(15), bytes([0x15]) + bytes(40),  # truncated, unknown opcode
            bytes([0x06]) + bytes(20),  # WRITE_FIRST cut short
            bytes(build(Opcode.RC_RDMA_WRITE_ONLY, dest_qp=ep.qp.qp_num, va=ep.mr.buf,
                        rkey=ep.mr.rkey, dma_len=4, payload=b"evil")),  # QP not connected
            bytes(build(Opcode.UD_SEND_ONLY, dest_qp=0x123456, payload=b"hi")),  # no such QP
            os.urandom(2000)]
    for j in junk:
        s.sendto(j, ("127.0.0.47", 4791))
    s.close()
    assert _wait(lambda: d.counters.rcvd_pkts >= len(junk) - 1)  # the empty datagram may count
    time.sleep(0.05)
    assert d.counters.malformed_pkts >= 4
    assert d.counters.dropped_pkts >= len(junk) - 1
    assert bytes(ep.mr.mem) == before  # nothing was written anywhere
    assert d.progress_thread.is_alive()
    ep.close()


def test_port_in_use_is_a_clear_error(udp_devices):
    udp_devices("127.0.0.48", "t-busy")
    other = add_device("127.0.0.48", name="t-busy2")
    try:
        with pytest.raises(TransportError, match="in use"):
            other.attach_udp()
    finally:
        unregister_device("t-busy2")


def test_manual_mode_is_single_threaded(udp_devices):
    threads0 = set(threading.enumerate())
    da = udp_devices("127.0.0.49", "t-m1", thread=False)
    db = udp_devices("127.0.0.50", "t-m2", thread=False)
    assert set(threading.enumerate()) == threads0
    a, b = _pair(da, db)
    b.post_recv(b.sge(0, 100), 1)
    a.post_send(IBV_WR_SEND, a.sge(0, 100), 2)
    for _ in range(200):
        da.poll(0.01), db.poll(0.01)
        if len(a.cq) and len(b.cq):
            break
    assert a.cq.poll_all()[0].status == 0 and b.cq.poll_all()[0].byte_len == 100
    a.close(), b.close()


def test_capture_by_environment_variable(tmp_path):
    pcap = tmp_path / "env.pcap"
    r = subprocess.run([sys.executable, "-m", "softrdma", "demo", "--addrs", "127.0.0.51",
                        "127.0.0.52", "--pcap", str(pcap)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "demo: all operations verified" in r.stdout
    ops = {parse(decode_frame(x.data).payload).name for x in read_pcap(pcap)}
    assert {"RC_SEND_FIRST", "RC_RDMA_WRITE_FIRST", "RC_RDMA_READ_REQUEST", "RC_FETCH_ADD",
            "RC_COMPARE_SWAP", "RC_ATOMIC_ACKNOWLEDGE", "RC_RDMA_READ_RESPONSE_LAST"} <= ops
    env = dict(os.environ, SOFTRDMA_PCAP=str(tmp_path / "from-env-{name}.pcap"))
    r = subprocess.run([sys.executable, "-c", """
import time
from softrdma.verbs_api.device import add_device
d = add_device('127.0.0.53', name='envdev'); d.attach_udp()
from softrdma.harness.testing import Endpoint, connect
from softrdma.verbs_api import Context, QPCap
cap = QPCap(max_send_wr=4, max_recv_wr=4)
a = Endpoint(Context(name='envdev'), 'RC', 4096, cap, 16); b = Endpoint(Context(name='envdev'), 'RC', 4096, cap, 16)
connect(a, b, 1, 2); connect(b, a, 2, 1)
b.post_recv(b.sge(0, 64), 1); a.post_send(2, a.sge(0, 64), 2)
t = time.time()
while len(b.cq) < 1 and time.time() - t < 5: time.sleep(0.001)
d.detach()
"""], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert len(list(read_pcap(tmp_path / "from-env-envdev.pcap"))) >= 2


def test_injected_tx_loss_is_seeded_and_counted(udp_devices, monkeypatch):
    monkeypatch.setenv("SOFTRDMA_TX_LOSS", "1.0")
    da = udp_devices("127.0.0.54", "t-loss")
    monkeypatch.delenv("SOFTRDMA_TX_LOSS")
    db = udp_devices("127.0.0.55", "t-noloss")
    assert da.faults.tx.random.loss == 1.0 and db.faults.tx.random.loss == 0.0
    a, b = _pair(da, db)
    b.post_recv(b.sge(0, 100), 1)
    a.post_send(IBV_WR_SEND, a.sge(0, 100), 2)
    time.sleep(0.2)
    assert len(b.cq) == 0  # nothing left device a
    assert da.counters.drops["injected_loss"] >= 1 and da.counters.sent_pkts == 0
    da.faults.tx.random.loss = 0.0  # the retransmit timer (timeout 14: 67 ms) delivers it now
    assert _wait(lambda: len(a.cq) >= 1 and len(b.cq) >= 1, timeout=5)
    assert a.cq.poll_all()[0].status == 0
    assert da.counters.completer_retry_err >= 1
    a.close(), b.close()


def test_bad_icrc_is_dropped_whatever_the_source_port():
    """Source port 0 is a legal value in the ICRC (the ConnectX CNP vector uses it): it must
    not switch verification off."""
    from softrdma.soft.device import SoftDevice
    d = SoftDevice("t-port0", "10.9.9.1")
    raw = build(Opcode.RC_SEND_ONLY, dest_qp=0x20, psn=1, payload=b"hi")  # ICRC left 0: wrong
    for sport in (0, 0xC001):
        d.receive(bytes(raw), bytes([10, 9, 9, 2]), d.ip_packed, sport=sport, verify_icrc=True)
    assert d.counters.icrc_err == 2 and d.counters.drops["bad_icrc"] == 2
