"""The progress thread and a polling application (softrdma.soft.progress): while the
application polls a CQ, the thread leaves the socket to it, looking again after longer and
longer graces; a program about to block in ``get_cq_event`` (or awaiting the channel)
hands receiving back to the thread at once, whatever the grace."""

from __future__ import annotations

import asyncio
import time

from softrdma.harness.testing import Endpoint, connect
from softrdma.verbs_api import CQ, CompChannel, Context, QPCap, QPInitAttr, QP
from softrdma.verbs_api.enums import IBV_QPT_RC, IBV_SEND_SIGNALED, IBV_WR_SEND

CAP = QPCap(max_send_wr=16, max_recv_wr=16, max_send_sge=1, max_recv_sge=1,
            max_inline_data=64)


def _pair(udp_devices, ips, names):
    da = udp_devices(ips[0], names[0])
    db = udp_devices(ips[1], names[1])
    ca, cb = Context(name=da.name), Context(name=db.name)
    ch = CompChannel(cb)
    rcq = CQ(cb, 16, None, ch, 0)
    a = Endpoint(ca, "RC", 1 << 16, CAP, 16)
    b = Endpoint(cb, "RC", 1 << 16, CAP, 16)
    b.qp.close()
    b.qp = QP(b.pd, QPInitAttr(qp_type=IBV_QPT_RC, scq=b.cq, rcq=rcq, cap=CAP))
    connect(a, b, 10, 20, timeout=18)
    connect(b, a, 20, 10, timeout=18)
    return db, a, b, ch, rcq


def _stand_back(monkeypatch, db):
    """b's application has just polled, and its thread would stand back for 30 s."""
    from softrdma.soft import progress
    monkeypatch.setattr(progress, "POLL_GRACE", 30.0)
    db.poll_nowait()
    time.sleep(2 * progress.MAX_SLEEP)  # the thread re-plans its wait with the long grace


def test_get_cq_event_hands_rx_back_to_the_thread(udp_devices, monkeypatch):
    """Polled a moment ago, then blocked in get_cq_event: the SEND is received by the
    thread within the timeout, not after the 30 s grace."""
    db, a, b, ch, rcq = _pair(udp_devices, ("127.0.17.21", "127.0.17.22"), ("pg-a", "pg-b"))
    _stand_back(monkeypatch, db)
    b.post_recv(b.sge(0, 64), 1)
    rcq.req_notify()
    a.mr.write(b"while b blocks", 14)
    a.post_send(IBV_WR_SEND, a.sge(0, 14), 2, flags=IBV_SEND_SIGNALED)
    t = time.monotonic()
    assert ch.get_cq_event(rcq, timeout=5) is rcq
    assert time.monotonic() - t < 5
    rcq.ack_events(1)
    (wc,) = rcq.poll_all()
    assert wc.byte_len == 14 and b.mr.read(14, 0) == b"while b blocks"


def test_awaiting_the_channel_hands_rx_back_too(udp_devices, monkeypatch):
    """The asyncio form of the same wait (``wait_async``)."""
    db, a, b, ch, rcq = _pair(udp_devices, ("127.0.17.23", "127.0.17.24"), ("pg-c", "pg-d"))
    _stand_back(monkeypatch, db)
    b.post_recv(b.sge(0, 64), 1)
    rcq.req_notify()
    a.post_send(IBV_WR_SEND, a.sge(0, 8), 2, flags=IBV_SEND_SIGNALED)

    async def wait() -> object:
        return await asyncio.wait_for(ch.wait_async(), 5)

    assert asyncio.run(wait()) is rcq
    rcq.ack_events(1)
    assert len(rcq.poll_all()) == 1


def test_the_thread_takes_rx_back_after_the_polls_stop(udp_devices, monkeypatch):
    """An application that polled for a while and then neither polls nor blocks (it
    sleeps) still gets its packets received: by the thread, after at most the longest
    grace (made 0.2 s here; the grace doubles from 1 ms while the polls go on)."""
    from softrdma.soft import progress
    monkeypatch.setattr(progress, "POLL_GRACE_MAX", 0.2)
    db, a, b, ch, rcq = _pair(udp_devices, ("127.0.17.25", "127.0.17.26"), ("pg-e", "pg-f"))
    end = time.monotonic() + 0.5
    while time.monotonic() < end:  # polls long enough for the grace to reach its cap
        rcq.poll(1)
        time.sleep(0.0005)
    b.post_recv(b.sge(0, 64), 1)
    before = db.counters.rcvd_pkts
    a.post_send(IBV_WR_SEND, a.sge(0, 8), 2, flags=IBV_SEND_SIGNALED)
    deadline = time.monotonic() + 5
    while db.counters.rcvd_pkts == before and time.monotonic() < deadline:
        time.sleep(0.01)  # the application sleeps: no poll, no blocking call
    assert db.counters.rcvd_pkts > before
