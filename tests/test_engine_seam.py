"""The protocol core works through its declared Protocols alone: two QP engines, a key
table and a few lines of fakes, no verbs object and no soft device.

This is the seam a second backend, a simulator or a teaching tool plugs into
(``softrdma.qp.interfaces``): if an engine ever reaches for something the Protocols do not
declare, these tests fail with an AttributeError on the fakes.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

from softrdma.completion import WC
from softrdma.counters import Counters
from softrdma.enums import (
    IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_WRITE, IBV_MTU_1024,
    IBV_QPS_ERR, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPT_RC, IBV_WC_RDMA_READ,
    IBV_WC_RECV, IBV_WC_SEND, IBV_WC_SUCCESS, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE,
    IBV_WR_SEND,
)
from softrdma.qp.engine import QpEngine
from softrdma.qp.memory import KeyTable
from softrdma.qp.wqe import RecvWqe, SendWqe
from softrdma.wire.packet import parse

ACCESS = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ


class Sink:
    """A CompletionSink: a list."""

    def __init__(self) -> None:
        self.wcs: list[WC] = []

    def push(self, wc: WC, solicited: bool = False) -> bool:
        self.wcs.append(wc)
        return True


class Wire:
    """Two DeviceServices sharing a virtual clock and an in-memory link that can lose
    chosen packets (by their index on the wire)."""

    def __init__(self, lose: set[int] = frozenset()) -> None:
        self.now = 0.0
        self.queue: list[tuple[QpEngine, bytes]] = []
        self.sent = 0
        self.lose = set(lose)
        self.timers: set[QpEngine] = set()
        self.events: list = []
        self.peer_of: dict[int, QpEngine] = {}

    def device(self, name: str) -> SimpleNamespace:
        wire = self

        class Dev:
            def __init__(self) -> None:
                self.name = name
                self.counters = Counters()
                self.keys = KeyTable(random.Random(name))
                self.active_mtu = IBV_MTU_1024
                self.limits = SimpleNamespace()
                self.trace = None  # no tracing (softrdma.trace)

            @property
            def now(self) -> float:
                return wire.now

            def send_packet(self, qp: QpEngine, pkt: bytearray, dst_ip: bytes | None,
                            tos: int = 0) -> None:
                i = wire.sent
                wire.sent += 1
                if i not in wire.lose:
                    wire.queue.append((wire.peer_of[qp.qp_num], bytes(pkt)))

            def timer_changed(self, qp: QpEngine) -> None:
                (wire.timers.add if qp.deadline is not None else wire.timers.discard)(qp)

            def emit_async(self, event) -> None:
                wire.events.append(event)

        return Dev()

    def run(self, limit: int = 10_000) -> None:
        """Deliver packets; when none is left, jump the clock to the next timer."""
        for _ in range(limit):
            if self.queue:
                eng, data = self.queue.pop(0)
                eng.on_packet(parse(data), b"")
                continue
            due = [q for q in self.timers if q.deadline is not None]
            if not due:
                return
            q = min(due, key=lambda e: e.deadline)
            self.now = q.deadline
            q.on_timer(self.now)
        raise AssertionError("the exchange did not settle")


def attrs(**kw):
    base = dict(qp_state=0, cur_qp_state=0, qp_access_flags=ACCESS, qkey=0,
                path_mtu=IBV_MTU_1024, dest_qp_num=0, timeout=14, retry_cnt=7, rnr_retry=7,
                min_rnr_timer=12, max_rd_atomic=4, max_dest_rd_atomic=4,
                en_sqd_async_notify=0)
    base.update(kw)
    return SimpleNamespace(**base)


def pair(wire: Wire):
    """Two RC engines connected to each other, each with a 64 KiB MR, brought to RTS the
    way the verbs layer does it (attributes, PSNs, path, states)."""
    ends = []
    for name, qpn in (("a", 0x11), ("b", 0x22)):
        dev = wire.device(name)
        pd = object()
        mr = dev.keys.register_mr(pd, memoryview(bytearray(1 << 16)), ACCESS)
        scq, rcq = Sink(), Sink()
        eng = QpEngine(dev, qpn, IBV_QPT_RC, pd, scq, rcq, None, attrs())
        ends.append(SimpleNamespace(dev=dev, eng=eng, mr=mr, scq=scq, rcq=rcq))
    a, b = ends
    wire.peer_of = {a.eng.qp_num: b.eng, b.eng.qp_num: a.eng}
    for me, other, sq_psn, rq_psn in ((a, b, 100, 0xFFFFF0), (b, a, 0xFFFFF0, 100)):
        e = me.eng
        e.set_state(IBV_QPS_INIT)
        e.attr.dest_qp_num = other.eng.qp_num
        e.set_av(SimpleNamespace(dst_ip=b"\x0a\x00\x00\x01", flow_label=0, traffic_class=0))
        e.set_rq_psn(rq_psn)
        e.set_resp_resources(4)
        e.set_state(IBV_QPS_RTR)
        e.set_sq_psn(sq_psn)
        e.set_state(IBV_QPS_RTS)
    return a, b


def send_wqe(wr_id, opcode, mr, offset, length, remote=None):
    w = SendWqe(wr_id, opcode, 0, True, [(mr.iova + offset, length, mr.lkey)], None, length)
    if remote is not None:
        rmr, roff = remote
        w.remote_addr, w.rkey = rmr.iova + roff, rmr.rkey
    return w


def test_send_write_and_read_through_the_protocols_alone():
    wire = Wire()
    a, b = pair(wire)
    a.mr.buf[:5000] = bytes(range(256)) * 19 + bytes(136)
    b.mr.buf[30000:30100] = b"R" * 100
    b.eng.rq.append(RecvWqe(7, [(b.mr.iova, 8192, b.mr.lkey)], 8192))
    a.eng.sq.append(send_wqe(1, IBV_WR_SEND, a.mr, 0, 5000))
    a.eng.sq.append(send_wqe(2, IBV_WR_RDMA_WRITE, a.mr, 0, 3000, remote=(b.mr, 10000)))
    a.eng.sq.append(send_wqe(3, IBV_WR_RDMA_READ, a.mr, 20000, 100, remote=(b.mr, 30000)))
    a.eng.kick()
    wire.run()
    assert [(w.wr_id, w.status, w.opcode) for w in a.scq.wcs] == [
        (1, IBV_WC_SUCCESS, IBV_WC_SEND), (2, IBV_WC_SUCCESS, 1), (3, IBV_WC_SUCCESS, IBV_WC_RDMA_READ)]
    (rwc,) = b.rcq.wcs
    assert (rwc.wr_id, rwc.status, rwc.opcode, rwc.byte_len) == (7, IBV_WC_SUCCESS, IBV_WC_RECV, 5000)
    assert bytes(b.mr.buf[:5000]) == bytes(a.mr.buf[:5000])
    assert bytes(b.mr.buf[10000:13000]) == bytes(a.mr.buf[:3000])
    assert bytes(a.mr.buf[20000:20100]) == b"R" * 100
    # 5 SEND packets + 3 WRITE + 1 READ request, 1 READ response, and ACKs: PSNs wrapped
    assert a.eng.req.psn == (100 + 5 + 3 + 1) & 0xFFFFFF


def test_a_lost_middle_packet_is_nakked_and_resent_at_once():
    wire = Wire(lose={1})  # the second of four SEND packets is lost once
    a, b = pair(wire)
    b.eng.rq.append(RecvWqe(7, [(b.mr.iova, 8192, b.mr.lkey)], 8192))
    a.eng.sq.append(send_wqe(1, IBV_WR_SEND, a.mr, 0, 4000))
    a.eng.kick()
    wire.run()
    assert [(w.wr_id, w.status) for w in a.scq.wcs] == [(1, IBV_WC_SUCCESS)]
    assert b.rcq.wcs[0].byte_len == 4000
    assert a.dev.counters.rcvd_seq_err == 1 and b.dev.counters.out_of_seq_request >= 1
    assert wire.now == 0.0  # the NAK did it: no timer had to fire


def test_a_lost_last_packet_is_resent_when_the_retransmit_timer_fires():
    wire = Wire(lose={3})  # the last SEND packet (the one asking for the ACK) is lost
    a, b = pair(wire)
    b.eng.rq.append(RecvWqe(7, [(b.mr.iova, 8192, b.mr.lkey)], 8192))
    a.eng.sq.append(send_wqe(1, IBV_WR_SEND, a.mr, 0, 4000))
    a.eng.kick()
    wire.run()
    assert [(w.wr_id, w.status) for w in a.scq.wcs] == [(1, IBV_WC_SUCCESS)]
    # IBTA: timeout 14 is 4.096 us * 2^14 = 67.1 ms, and the clock moved exactly that far
    assert wire.now == 4.096e-6 * (1 << 14)
    assert a.dev.counters.rcvd_seq_err == 0


def test_a_bad_rkey_completes_in_error_and_moves_both_to_err():
    wire = Wire()
    a, b = pair(wire)
    w = send_wqe(1, IBV_WR_RDMA_WRITE, a.mr, 0, 64, remote=(b.mr, 0))
    w.rkey ^= 0x5A5A5A
    a.eng.sq.append(w)
    a.eng.kick()
    wire.run()
    assert a.scq.wcs[0].status != IBV_WC_SUCCESS
    assert a.eng.state == IBV_QPS_ERR and b.eng.state == IBV_QPS_ERR
