"""Post lists: a chain of WRs in one ``post_send``, over real UDP on 127.0.2.x.

What a list must do (ibv_post_send, librxe's ``post_send``): every WR up to the first bad
one is posted and sent, the bad one and those after it are not, and ``bad_wr`` names the
bad one; the WRs of one post leave with one flush, equal-size packets for one destination
as one train (UDP GSO); and the train's ACKs, coalesced by the responder, are one ACK that
completes every WR of the train.
"""

from __future__ import annotations

import errno

import pytest

from softrdma.enums import IBV_WR_RDMA_WRITE
from softrdma.errors import PyverbsRDMAError
from softrdma.harness.testing import Endpoint, connect
from softrdma.verbs_api import QPCap, Context, SendWR

from .conftest import wait_until

CAP = QPCap(max_send_wr=256, max_recv_wr=256, max_send_sge=4, max_recv_sge=4,
            max_inline_data=64)
SIGNALED = 2
SLOT = 256  # each WR writes its own 256-byte slot of the peer's MR


def _pair(udp_devices, n: int, sender_thread: bool = True):
    """A sender (live unless told otherwise) and a live receiver on 127.0.2.(2n)/(2n+1),
    their RC QPs connected."""
    da = udp_devices(f"127.0.2.{2 * n}", f"pl-a{n}", thread=sender_thread)
    db = udp_devices(f"127.0.2.{2 * n + 1}", f"pl-b{n}")
    a = Endpoint(Context(name=da.name), "RC", 1 << 16, CAP, 256)
    b = Endpoint(Context(name=db.name), "RC", 1 << 16, CAP, 256)
    connect(a, b, 100, 200)
    connect(b, a, 200, 100)
    return da, db, a, b


def _writes(a: Endpoint, b: Endpoint, count: int, size: int = 64) -> list[SendWR]:
    """``count`` signaled WRITEs of ``size`` bytes; WR i writes byte value i + 1 to slot i."""
    wrs = []
    for i in range(count):
        a.mr.write(bytes([i + 1]) * size, size, i * SLOT)
        wr = SendWR(i, opcode=IBV_WR_RDMA_WRITE, sg=[a.sge(i * SLOT, size)],
                    send_flags=SIGNALED)
        wr.set_wr_rdma(b.mr.rkey, b.mr.buf + i * SLOT)
        wrs.append(wr)
    return wrs


def _slot(b: Endpoint, i: int, size: int = 64) -> bytes:
    return b.mr.read(size, i * SLOT)


@pytest.mark.parametrize("form", ["list", "chain"])
def test_an_error_in_the_middle_of_the_chain(udp_devices, form):
    """WR 2 of 5 has send_flags bits no verb knows: post_send raises EINVAL with bad_wr =
    WR 2 (and bad_wr_index 2, and the caller's bad_wr filled in); WRs 0 and 1 are posted
    and sent (their data lands, they complete successfully), WRs 2..4 are not (no data,
    no completion, nothing left in the send queue); the QP stays usable, and the rest can
    be posted again."""
    da, db, a, b = _pair(udp_devices, 1 if form == "list" else 2)
    wrs = _writes(a, b, 5)
    wrs[2].send_flags = 0x100
    sent_before = da.counters.sent_pkts
    bad = SendWR()
    if form == "chain":
        for w, nxt in zip(wrs, wrs[1:]):
            w.next_wr = nxt
    with pytest.raises(PyverbsRDMAError) as ei:
        a.qp.post_send(wrs if form == "list" else wrs[0], bad)
    assert ei.value.error_code == errno.EINVAL
    assert ei.value.bad_wr is wrs[2] and ei.value.bad_wr_index == 2
    assert bad.wr_id == 2
    assert wait_until(lambda: len(a.cq) >= 2)
    wcs = a.cq.poll_all()
    assert [(wc.wr_id, wc.status) for wc in wcs] == [(0, 0), (1, 0)]
    assert da.counters.sent_pkts - sent_before == 2  # WRs 0 and 1: one packet each
    assert not a.qp.sq  # nothing of WRs 2..4 was queued
    assert [_slot(b, i) for i in range(5)] == [b"\x01" * 64, b"\x02" * 64] + [bytes(64)] * 3
    wrs[2].send_flags = SIGNALED
    for w in wrs:
        w.next_wr = None
    a.qp.post_send(wrs[2:])
    assert wait_until(lambda: len(a.cq) >= 3)
    assert [wc.wr_id for wc in a.cq.poll_all()] == [2, 3, 4]
    assert [_slot(b, i) for i in range(5)] == [bytes([i + 1]) * 64 for i in range(5)]


@pytest.mark.parametrize("doorbell", ["0", "1"])
def test_a_list_of_equal_writes_leaves_as_one_train(udp_devices, monkeypatch, doorbell):
    """A list of 16 equal 64-byte WRITEs to one QP is one flush (the transport's
    pending_peak reaches 16) and one train (gso_trains + 1 carrying 16 packets), with the
    doorbell on or off: a list is one post. Its ACKs are coalesced by the receiver into one
    ACK (the train arrived as one GRO datagram), which completes all 16."""
    monkeypatch.setenv("SOFTRDMA_DOORBELL", doorbell)
    da, db, a, b = _pair(udp_devices, 3 + int(doorbell))
    assert da.udp.gso and db.udp.gro, "this kernel lacks UDP GSO/GRO (Linux >= 5.0)"
    wrs = _writes(a, b, 16)
    trains, packets = da.counters.gso_trains, da.counters.gso_packets
    acks = db.counters.sent_pkts
    a.qp.post_send(wrs)
    assert da.udp.pending_peak >= 16
    assert da.counters.gso_trains - trains == 1
    assert da.counters.gso_packets - packets == 16
    assert wait_until(lambda: len(a.cq) >= 16)
    assert [wc.wr_id for wc in a.cq.poll_all()] == list(range(16))
    assert all(_slot(b, i) == bytes([i + 1]) * 64 for i in range(16))
    assert db.counters.gro_trains >= 1
    assert db.counters.sent_pkts - acks == 1  # one coalesced ACK for the last PSN


def test_without_coalescing_every_ackreq_is_acked(udp_devices, monkeypatch):
    """SOFTRDMA_ACK_COALESCE=0: the same train of 16 WRITEs gets 16 ACKs, one per AckReq
    (rxe's responder), and the completions are the same."""
    monkeypatch.setenv("SOFTRDMA_ACK_COALESCE", "0")
    da, db, a, b = _pair(udp_devices, 5)
    wrs = _writes(a, b, 16)
    acks = db.counters.sent_pkts
    a.qp.post_send(wrs)
    assert wait_until(lambda: len(a.cq) >= 16)
    assert [wc.wr_id for wc in a.cq.poll_all()] == list(range(16))
    assert db.counters.sent_pkts - acks == 16
