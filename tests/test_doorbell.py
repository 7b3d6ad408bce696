"""Doorbell batching (softrdma.soft.lock, ``SOFTRDMA_DOORBELL``), over real UDP on 127.0.2.x.

A post to a QP that already has work in flight may leave its packets queued for the next
flush. What must hold: someone flushes them without the program's help when it blocks (the
progress thread of a live device, woken by the post); in manual mode only a polling
program defers, and its next call into the device flushes; a verbs call that follows
(modify to ERR, destroy, detach) sends them, never drops them; ``SOFTRDMA_DOORBELL=0``
flushes every post.

The receiver is a manual device (no progress thread) that nothing drives while the sender
posts, so the sender's first WRITE stays unacknowledged and the posts after it find the
QP busy: the deferral is certain, not a race.
"""

from __future__ import annotations

import threading

import pytest

from softrdma.enums import IBV_QPT_RC, IBV_WR_RDMA_WRITE, ibv_qp_state
from softrdma.harness.testing import ALL_ACCESS, Endpoint, connect
from softrdma.soft import progress
from softrdma.verbs_api import (
    CQ, MR, PD, QP, CompChannel, Context, QPAttr, QPCap, QPInitAttr, SendWR,
)

from .conftest import wait_until

CAP = QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=4, max_recv_sge=4,
            max_inline_data=64)
SIGNALED = 2
SLOT = 256
COUNT = 8


class ChannelEndpoint(Endpoint):
    """An Endpoint whose CQ has a completion channel (for get_cq_event)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.device = ctx.device
        self.pd = PD(ctx)
        self.channel = CompChannel(ctx)
        self.cq = CQ(ctx, 256, None, self.channel, 0)
        self.mr = MR(self.pd, 1 << 16, ALL_ACCESS)
        self.qp_type = "RC"
        self.qp = QP(self.pd, QPInitAttr(qp_type=IBV_QPT_RC, scq=self.cq, rcq=self.cq,
                                         cap=CAP, sq_sig_all=0))
        self.ah = None
        self.peer = None

    def close(self) -> None:
        self.ctx.close()


def _pair(udp_devices, n: int, *, sender_thread: bool):
    """Sender on 127.0.2.(100+2n) (live or manual), manual receiver on the next address;
    no retransmit timer (timeout 0), so only the doorbell's machinery can flush."""
    da = udp_devices(f"127.0.2.{100 + 2 * n}", f"db-a{n}", thread=sender_thread)
    db = udp_devices(f"127.0.2.{101 + 2 * n}", f"db-b{n}", thread=False)
    a = ChannelEndpoint(Context(name=da.name))
    b = Endpoint(Context(name=db.name), "RC", 1 << 16, CAP, 256)
    connect(a, b, 100, 200, timeout=0)
    connect(b, a, 200, 100, timeout=0)
    return da, db, a, b


def _post_writes(a: Endpoint, b: Endpoint, count: int = COUNT) -> None:
    """``count`` signaled 64-byte WRITEs, one post each; WR i writes i + 1 to slot i."""
    for i in range(count):
        a.mr.write(bytes([i + 1]) * 64, 64, i * SLOT)
        wr = SendWR(i, opcode=IBV_WR_RDMA_WRITE, sg=[a.sge(i * SLOT, 64)],
                    send_flags=SIGNALED)
        wr.set_wr_rdma(b.mr.rkey, b.mr.buf + i * SLOT)
        a.qp.post_send(wr)


def _landed(b: Endpoint, count: int = COUNT) -> bool:
    return all(b.mr.read(64, i * SLOT) == bytes([i + 1]) * 64 for i in range(count))


class _Driver:
    """Drives a manual device from a thread of its own (the peer's NIC)."""

    def __init__(self, dev) -> None:
        self.dev = dev
        self.stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        while not self.stop:
            self.dev.poll(0.005)

    def close(self) -> None:
        self.stop = True
        self.t.join(5)


def test_post_then_block_in_get_cq_event_live(udp_devices, monkeypatch):
    """A live sender posts 8 WRITEs (7 of them deferred: the QP is busy) and blocks in
    get_cq_event: the progress thread, woken by the first deferring post, sends them, and
    the completions come. Nothing else could flush them within the 10 s the wait allows:
    the first WRITE is lost on the way out (so no ACK wakes the sender), there is no
    retransmit timer, and the thread's idle wake-up is pushed to 30 s. (The receiver
    NAKs the gap the deferred WRITEs show, and the sender goes back to the first.)"""
    monkeypatch.setattr(progress, "MAX_SLEEP", 30.0)
    da, db, a, b = _pair(udp_devices, 1, sender_thread=True)
    assert da.progress_thread is not None and da.lock.batching
    lost = da.faults.tx.drop("RC_RDMA_WRITE_ONLY")
    a.cq.req_notify()
    driver = _Driver(db)
    try:
        deferred = da.lock.deferrals
        _post_writes(a, b)
        assert da.lock.deferrals > deferred  # the doorbell did defer (the path under test)
        got = []
        while len(got) < COUNT:
            a.channel.get_cq_event(a.cq, timeout=10)
            a.cq.ack_events(1)
            a.cq.req_notify()
            got += [(wc.wr_id, wc.status) for wc in a.cq.poll_all()]
        assert got == [(i, 0) for i in range(COUNT)]
        assert len(lost.hits) == 1
        assert _landed(b)
    finally:
        driver.close()


def test_manual_mode_defers_only_for_a_polling_program(udp_devices):
    """Without a progress thread: a program that posts without polling has every packet
    sent by its post (nothing pending after each); one that polled its CQ first defers
    (packets pending after the posts), and its next poll sends them."""
    da, db, a, b = _pair(udp_devices, 2, sender_thread=False)
    assert da.progress_thread is None
    deferred = da.lock.deferrals
    for i in range(3):
        wr = SendWR(i, opcode=IBV_WR_RDMA_WRITE, sg=[a.sge(0, 64)], send_flags=SIGNALED)
        wr.set_wr_rdma(b.mr.rkey, b.mr.buf)
        a.qp.post_send(wr)
        assert da.udp.pending == 0
    assert da.lock.deferrals == deferred
    a.cq.poll(1)  # the program polls: from now on its posts may wait for the next poll
    _post_writes(a, b)
    assert da.udp.pending > 0 and da.lock.deferrals > deferred
    a.cq.poll(1)
    assert da.udp.pending == 0
    driver = _Driver(db)
    try:
        assert wait_until(lambda: (da.poll(0.005), len(a.cq))[1] >= 3 + COUNT)
        assert _landed(b)
    finally:
        driver.close()


@pytest.mark.parametrize("then", ["modify_to_err", "destroy_qp", "detach"])
def test_deferred_packets_leave_with_the_next_verb(udp_devices, then):
    """Posts deferred by a polling program, then a verbs call that stops the QP (modify
    to ERR, destroy) or the device (detach): the queued packets leave with that call's
    release (nothing pending after it) and the receiver gets every WRITE's data."""
    da, db, a, b = _pair(udp_devices, 3 + ["modify_to_err", "destroy_qp", "detach"].index(then),
                         sender_thread=False)
    a.cq.poll(1)
    _post_writes(a, b)
    assert da.udp.pending > 0
    sent = da.counters.sent_pkts
    if then == "modify_to_err":
        a.qp.modify(QPAttr(qp_state=ibv_qp_state.IBV_QPS_ERR), 1)  # IBV_QP_STATE
        assert da.udp.pending == 0
    elif then == "destroy_qp":
        a.qp.close()
        assert da.udp.pending == 0
    else:
        udp = da.udp
        da.detach()
        assert udp.pending == 0
    assert da.counters.sent_pkts == sent  # counted when queued: none was dropped since
    driver = _Driver(db)
    try:
        assert wait_until(lambda: _landed(b))
    finally:
        driver.close()


@pytest.mark.parametrize("doorbell", ["0", "1"])
def test_the_switch(udp_devices, monkeypatch, doorbell):
    """SOFTRDMA_DOORBELL=0: a polling program's posts to a busy QP are flushed each at
    once (nothing pending, no deferral); =1: they are deferred. Either way every WRITE
    completes and lands."""
    monkeypatch.setenv("SOFTRDMA_DOORBELL", doorbell)
    da, db, a, b = _pair(udp_devices, 6 + int(doorbell), sender_thread=False)
    assert da.lock.batching == (doorbell == "1")
    a.cq.poll(1)
    deferred = da.lock.deferrals
    _post_writes(a, b)
    if doorbell == "0":
        assert da.udp.pending == 0 and da.lock.deferrals == deferred
    else:
        assert da.udp.pending == COUNT - 1 and da.lock.deferrals - deferred == COUNT - 1
    driver = _Driver(db)
    try:
        assert wait_until(lambda: (da.poll(0.005), len(a.cq))[1] >= COUNT)
        assert [wc.wr_id for wc in a.cq.poll_all()] == list(range(COUNT))
        assert _landed(b)
    finally:
        driver.close()
