"""Zero-copy sending (softrdma.wire.iov): packets as lists of buffers whose payload is a view
of the MR, from the requester and the responder's READ RESPONSEs to ``sendmsg``.

What the view means, and what these tests hold the device to (docs/wire.md, "Zero copy"):
the bytes of the MR leave when the packet is sent, so a retransmission re-reads the MR and
carries what it holds then, with an ICRC computed over those bytes; what keeps a packet
(the capture, the fault injector, the in-device loopback) keeps the bytes of the moment it
was sent, not a view. Real UDP sockets on 127.0.1.x (helper 1's addresses), devices driven
by hand (``attach_udp(thread=False)``) so a test decides what happens between two steps.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest

from softrdma.enums import IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE, IBV_WR_SEND, ibv_mtu
from softrdma.harness.sim import SimNetwork
from softrdma.harness.testing import Endpoint, connect, connected_pair
from softrdma.verbs_api import Context, QPCap
from softrdma.wire.frames import decode_frame
from softrdma.wire.icrc import icrc_from_ip_packet
from softrdma.wire.iov import packet_bytes
from softrdma.wire.packet import parse
from softrdma.wire.pcap import read_pcap

MTU = 4096
CAP = QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=1, max_recv_sge=1)
PSN0 = 100


def _pattern(n: int, seed: int) -> bytes:
    return bytes((i * 7 + seed * 31 + (i >> 12)) & 0xFF for i in range(n))


def _drive(devs: list, until: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll the manual devices in turn until ``until()`` (or fail after ``timeout``)."""
    end = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < end, "timed out"
        for d in devs:
            d.poll(0.002)


def _pair(udp_devices, tmp_path, tag: str, ips: tuple[str, str],
          size: int = 1 << 18) -> tuple[Any, Any, Endpoint, Endpoint]:
    """Two manual devices with captures, the second reading from a raw socket (as root,
    as tests/test_trains.py does): it sees each packet's real IPv4 ID, so it checks every
    ICRC (a UDP socket cannot), a train's moved ones included."""
    da = udp_devices(ips[0], f"{tag}-a", thread=False, capture=str(tmp_path / f"{tag}-a.pcap"))
    db = udp_devices(ips[1], f"{tag}-b", thread=False, capture=str(tmp_path / f"{tag}-b.pcap"),
                     raw_rx=True)
    assert db.verify_icrc
    a = Endpoint(Context(name=da.name), "RC", size, CAP, 256)
    b = Endpoint(Context(name=db.name), "RC", size, CAP, 256)
    mtu = dict(path_mtu=ibv_mtu.IBV_MTU_4096, timeout=18)
    connect(a, b, PSN0, PSN0 + 5000, **mtu)
    connect(b, a, PSN0 + 5000, PSN0, **mtu)
    return da, db, a, b


def _roce_packets(path: Any) -> list[tuple[Any, Any]]:
    """(frame, parsed RoCE packet) of every packet in a capture, each ICRC checked from its
    own IP header by the independent definition (icrc_from_ip_packet)."""
    out = []
    for rec in read_pcap(path):
        f = decode_frame(rec.data)
        roce = bytes(f.payload)
        assert icrc_from_ip_packet(f.ip_packet) == int.from_bytes(roce[-4:], "little"), \
            f"bad ICRC in the capture: {parse(roce)!r}"
        out.append((f, parse(roce)))
    return out


@pytest.mark.parametrize("where", ["tx", "rx"])
@pytest.mark.parametrize("gso", ["0", "1"], ids=["packets", "trains"])
def test_retransmission_after_the_mr_changed_carries_the_new_bytes(udp_devices, tmp_path,
                                                                   monkeypatch, gso, where):
    """A MIDDLE of a zero-copy WRITE is lost (a fault at the sender, which then joins each
    packet into bytes, or at the receiver, so the sender's lists of buffers go all the way
    to sendmsg), the receiver NAKs, the application then rewrites its buffer, and the
    go-back-N resend reads the MR again: the receiver ends with the old bytes before the
    lost packet and the new ones from it on; every packet on the wire has an ICRC right for
    its own bytes and IP ID (the raw receiver checks each; both captures are checked
    independently), the resent ones included. Guards the ICRC continued over the view, the
    train's ICRC moves for lists, and that no stale copy is resent."""
    monkeypatch.setenv("SOFTRDMA_ZEROCOPY", "1")
    monkeypatch.setenv("SOFTRDMA_GSO", gso)
    n = 21 + 2 * int(gso) + 4 * (where == "rx")
    tag = f"zc-rt{gso}{where}"
    da, db, a, b = _pair(udp_devices, tmp_path, tag, (f"127.0.1.{n}", f"127.0.1.{n + 1}"))
    assert da.zero_copy and db.zero_copy
    size = 16 * MTU  # FIRST, 14 MIDDLEs, LAST
    old, new = _pattern(size, 1), _pattern(size, 2)
    a.mr.write(old, size, 0)
    lost = 3  # the third MIDDLE: PSN0 + 3
    (da.faults.tx if where == "tx" else db.faults.rx).drop("RC_RDMA_WRITE_MIDDLE", nth=lost)
    a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, size), wr_id=1, remote_offset=0)
    _drive([db], lambda: db.counters.out_of_seq_request >= 1)  # the NAK is on its way
    a.mr.write(new, size, 0)  # before the sender hears of it
    _drive([da, db], lambda: len(a.cq) >= 1)
    assert [w.status for w in a.cq.poll_all()] == [0]
    assert b.mr.read(size, 0) == old[:lost * MTU] + new[lost * MTU:]

    sent: dict[int, list[bytes]] = {}
    for f, p in _roce_packets(tmp_path / f"{tag}-a.pcap"):
        if p.info.write:
            sent.setdefault(p.psn - PSN0, []).append(bytes(p.payload))
    chunk = [(old[k * MTU:(k + 1) * MTU], new[k * MTU:(k + 1) * MTU]) for k in range(16)]
    for k in range(lost):
        assert sent[k] == [chunk[k][0]]  # acknowledged by the NAK: never resent
    # lost (before the sender's capture, or after it), then resent from the rewritten MR
    assert sent[lost] == ([chunk[lost][1]] if where == "tx" else list(chunk[lost]))
    for k in range(lost + 1, 16):
        assert sent[k] == [chunk[k][0], chunk[k][1]]  # dropped by the receiver, resent
    got = [p for _, p in _roce_packets(tmp_path / f"{tag}-b.pcap") if p.info.write]
    assert len(got) == sum(len(v) for v in sent.values()) - (where == "rx")
    assert db.counters.icrc_err == 0 and db.counters.rcvd_pkts >= len(got)
    # trains (of lists of buffers when the sender has no fault to join them for)
    assert (da.counters.gso_trains > 0) == (gso == "1")


def test_a_capture_of_a_zero_copy_send_is_the_wire(udp_devices, tmp_path, monkeypatch):
    """The sender's capture (which joins each list of buffers when the packet is sent)
    holds the bytes the receiver's socket got, packet for packet (the ICRC aside, which a
    train's IPv4 ID changes: each is checked against its own IP header), for a SEND, a
    WRITE and the zero-copy READ RESPONSEs of a READ."""
    monkeypatch.setenv("SOFTRDMA_ZEROCOPY", "1")
    monkeypatch.setenv("SOFTRDMA_GSO", "1")
    da, db, a, b = _pair(udp_devices, tmp_path, "zc-cap", ("127.0.1.25", "127.0.1.26"))
    size = 5 * MTU + 1000
    a.mr.write(_pattern(size, 3), size, 0)
    b.mr.write(_pattern(size, 4), size, 2 * size)
    b.post_recv(b.sge(0, size), wr_id=9)
    a.post_send(IBV_WR_SEND, a.sge(0, size), wr_id=1)
    a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, size), wr_id=2, remote_offset=size)
    a.post_send(IBV_WR_RDMA_READ, a.sge(size, size), wr_id=3, remote_offset=2 * size)
    _drive([da, db], lambda: len(a.cq) >= 3 and len(b.cq) >= 1)
    assert [w.status for w in a.cq.poll_all()] == [0, 0, 0]
    assert b.mr.read(size, 0) == b.mr.read(size, size) == _pattern(size, 3)
    assert a.mr.read(size, size) == _pattern(size, 4)
    for x, y in ((da, db), (db, da)):
        tx = [(f, p) for f, p in _roce_packets(tmp_path / f"zc-cap-{'a' if x is da else 'b'}.pcap")
              if f.ip_src == x.ip_packed]
        rx = [(f, p) for f, p in _roce_packets(tmp_path / f"zc-cap-{'b' if x is da else 'a'}.pcap")
              if f.ip_src == x.ip_packed]
        assert len(tx) == len(rx) > 0
        for (ft, _), (fr, _) in zip(tx, rx):
            assert bytes(ft.payload)[:-4] == bytes(fr.payload)[:-4]
    # the zero-copy paths were taken: data packets of a full MTU from both engines
    assert any(p.info.read and p.payload_len == MTU for _, p in
               _roce_packets(tmp_path / "zc-cap-b.pcap") if p.info.is_response)


def test_the_loopback_queue_keeps_the_bytes_of_the_send(monkeypatch):
    """A device with no transport queues what it sends to itself until ``progress()``;
    a zero-copy packet is joined when queued, so a buffer rewritten after the post does not
    change what the receiving QP gets (rxe's loopback queues a copy too)."""
    monkeypatch.setenv("SOFTRDMA_ZEROCOPY", "1")
    from softrdma.verbs_api.device import add_device, unregister_device
    dev = add_device("127.0.1.27", name="zc-loop", live=False)
    try:
        a = Endpoint(Context(name=dev.name), "RC", 1 << 16, CAP, 64)
        c = Endpoint(Context(name=dev.name), "RC", 1 << 16, CAP, 64)
        connect(a, c, 1, 2, path_mtu=ibv_mtu.IBV_MTU_4096)
        connect(c, a, 2, 1, path_mtu=ibv_mtu.IBV_MTU_4096)
        old, new = _pattern(3 * MTU, 5), _pattern(3 * MTU, 6)
        a.mr.write(old, len(old), 0)
        kinds: list = []
        real = dev.send_packet

        def spy(qp, pkt, dst, tos=0):
            kinds.append(type(pkt))
            real(qp, pkt, dst, tos)

        monkeypatch.setattr(dev, "send_packet", spy)
        a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, len(old)), wr_id=1, remote_offset=0)
        assert kinds.count(list) == 3  # the packets were lists of buffers ...
        assert len(dev._rxq) == 3  # ... queued, not yet delivered
        a.mr.write(new, len(new), 0)
        for _ in range(100):
            if a.ncomp():
                break
            dev.progress()
        assert [w.status for w in a.cq.poll_all()] == [0]
        assert c.mr.read(len(old), 0) == old
        a.close(), c.close()
    finally:
        unregister_device(dev.name)


def _sim_run(monkeypatch, zc: str) -> tuple[list, list[bytes]]:
    """A SEND, a WRITE and a READ of 3 MTUs and a bit on the simulated link: the types
    of the packets the engines handed to send_packet, and the packets' bytes."""
    monkeypatch.setenv("SOFTRDMA_ZEROCOPY", zc)
    net = SimNetwork(seed=11)
    a, b = connected_pair(net, mtu=65536, psns=(7, 9),
                          a_attrs=dict(path_mtu=ibv_mtu.IBV_MTU_4096),
                          b_attrs=dict(path_mtu=ibv_mtu.IBV_MTU_4096))
    assert a.device.zero_copy == (zc == "1")
    kinds: list = []
    wire: list[bytes] = []
    for dev in (a.device, b.device):
        def spy(qp, pkt, dst, tos=0, _real=dev.send_packet):
            kinds.append(type(pkt))
            _real(qp, pkt, dst, tos)
            wire.append(packet_bytes(pkt))

        monkeypatch.setattr(dev, "send_packet", spy)
    size = 3 * MTU + 100
    a.mr.write(_pattern(size, 8), size, 0)
    b.mr.write(_pattern(size, 9), size, 4 * MTU)
    b.post_recv(b.sge(0, size), wr_id=1)
    a.post_send(IBV_WR_SEND, a.sge(0, size), wr_id=2)
    a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, size), wr_id=3, remote_offset=8 * MTU)
    a.post_send(IBV_WR_RDMA_READ, a.sge(12 * MTU, size), wr_id=4, remote_offset=4 * MTU)
    net.run_until(lambda: a.ncomp() >= 3 and b.ncomp() >= 1)
    assert [w.status for w in a.cq.poll_all()] == [0, 0, 0]
    assert b.mr.read(size, 0) == b.mr.read(size, 8 * MTU) == _pattern(size, 8)
    assert a.mr.read(size, 12 * MTU) == _pattern(size, 9)
    assert a.device.counters.icrc_err == b.device.counters.icrc_err == 0
    net.close()
    return kinds, wire


def test_the_switch_chooses_the_path_and_the_bytes_are_the_same(monkeypatch):
    """SOFTRDMA_ZEROCOPY=0 keeps the copying path (one bytearray per packet), 1 hands
    lists of buffers to send_packet for the full-MTU data packets of both engines; the
    packets are the same bytes either way (seeded devices: the same QPNs, keys, PSNs)."""
    kinds0, wire0 = _sim_run(monkeypatch, "0")
    kinds1, wire1 = _sim_run(monkeypatch, "1")
    assert list not in kinds0
    # SEND and WRITE: FIRST + 2 MIDDLEs each; READ: 3 full RESPONSEs; the 100-byte LASTs
    # are below ZERO_COPY_MIN and copied
    assert kinds1.count(list) == 9
    # (the pairs have different addresses, so different ICRCs: those are checked by the
    # receiving device, which accepted every packet)
    assert [p[:-4] for p in wire0] == [p[:-4] for p in wire1] and len(wire0) > 12


def test_zero_copy_with_random_loss_and_reads(monkeypatch):
    """Random loss both ways on the simulated link (requests and responses, READ
    RESPONSEs from views included): every message arrives whole and in order."""
    monkeypatch.setenv("SOFTRDMA_ZEROCOPY", "1")
    net = SimNetwork(seed=3, loss=0.08)
    a, b = connected_pair(net, mtu=65536, a_attrs=dict(path_mtu=ibv_mtu.IBV_MTU_4096,
                                                       timeout=8),
                          b_attrs=dict(path_mtu=ibv_mtu.IBV_MTU_4096, timeout=8))
    size = 6 * MTU + 77
    for r in range(4):
        a.mr.write(_pattern(size, 20 + r), size, 0)
        b.mr.write(_pattern(size, 40 + r), size, 2 * size)
        a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, size), wr_id=r, remote_offset=size)
        a.post_send(IBV_WR_RDMA_READ, a.sge(size, size), wr_id=100 + r,
                    remote_offset=2 * size)
        net.run_until(lambda: a.ncomp() >= 2)
        assert [w.status for w in a.cq.poll_all()] == [0, 0]
        assert b.mr.read(size, size) == _pattern(size, 20 + r)
        assert a.mr.read(size, size) == _pattern(size, 40 + r)


@pytest.mark.parametrize("n", [512, 513, 514, 515, 4096])
def test_lists_of_buffers_are_the_joined_packet_on_the_wire(n):
    """For every pad: a list-of-buffers packet (REQUEST_IOV_BUILDERS, build_iov) joins to
    the copying builders' bytes; its ICRC (icrc_ipv4_iov / icrc_ipv6_iov, continued over
    the view) is the one over the joined bytes; and a train of such packets gives sendmsg
    the same bytes as a train of the joined packets, over IPv4 (ICRCs moved to IP IDs
    1, 2, ...) and IPv6."""
    import random
    from softrdma.wire.icrc import icrc_ipv4, icrc_ipv4_iov, icrc_ipv6, icrc_ipv6_iov
    from softrdma.wire.opcodes import Opcode as O
    from softrdma.wire.packet import REQUEST_BUILDERS, REQUEST_IOV_BUILDERS, build, build_iov
    from softrdma.wire.trains import train_iov

    rng = random.Random(n)
    mr = bytearray(rng.randbytes(4 * n))
    v4 = (bytes([127, 0, 1, 2]), bytes([127, 0, 1, 1]))
    v6 = (bytes(15) + b"\x02", bytes(15) + b"\x01")
    pkts, lists = [], []
    for k, op in enumerate((O.RC_RDMA_WRITE_MIDDLE, O.RC_SEND_ONLY_WITH_IMMEDIATE,
                            O.RC_RDMA_WRITE_FIRST)):
        view = memoryview(mr)[k * n:(k + 1) * n]
        args = (op, 40 + k, 0x1234, k == 1, k == 1, 0x10000, 0x55, 3 * n, 0, 0, 7, 7, 0, 0)
        flat = REQUEST_BUILDERS[op](*args, view)
        iov = REQUEST_IOV_BUILDERS[op](*args, view)
        assert type(iov) is list and iov[1] is view and b"".join(iov) == flat
        for (src, dst), whole, parts in ((v4, icrc_ipv4, icrc_ipv4_iov),
                                         (v6, icrc_ipv6, icrc_ipv6_iov)):
            assert parts(iov, src, dst, 0xC123) == whole(flat, src, dst, 0xC123)
        c = icrc_ipv4(flat, *v4, 0xC123)
        flat[-4:] = c.to_bytes(4, "little")
        iov[2] = iov[2][:-4] + c.to_bytes(4, "little")
        pkts.append(bytes(flat))
        lists.append(iov)
    resp = build_iov(O.RC_RDMA_READ_RESPONSE_MIDDLE, payload=memoryview(mr)[:n], psn=3,
                     dest_qp=9, msn=4)
    assert b"".join(resp) == build(O.RC_RDMA_READ_RESPONSE_MIDDLE, payload=mr[:n], psn=3,
                                   dest_qp=9, msn=4)
    for ipv4 in (True, False):
        want = b"".join(bytes(b) for b in train_iov(pkts, ipv4))
        assert b"".join(bytes(b) for b in train_iov(lists, ipv4)) == want
        # mixed: one buffer and lists in one train
        mixed = [pkts[0], lists[1], pkts[2]]
        assert b"".join(bytes(b) for b in train_iov(mixed, ipv4)) == want
