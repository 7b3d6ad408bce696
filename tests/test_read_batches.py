"""A READ's response leaves in bounded batches (issue 26, point 7; softrdma.qp.responder).

rxe's responder sends one READ RESPONSE per pass of its task and yields after a budget of
passes, keeping the READ under way in ``qp->resp.res``; softrdma sends at most
``READ_RESPONSE_BATCH`` packets per pass and the device gives the responder its next pass
(``SoftDevice.schedule_responder`` / ``run_responders``) after what is queued has left and
the other QPs have had theirs. Before, one READ of up to 2 GiB was built whole in one hold
of the device lock: a peer's 64 MiB READ queued 16,384 packets (+66 MiB) and the device
answered nothing else until they were all built.

The live tests use real UDP sockets on loopback; the others a seeded SimNetwork, whose
steps are the device's passes, so what one pass sends is counted exactly.
"""

from __future__ import annotations

import io
import time
import tracemalloc

from softrdma import trace
from softrdma.enums import (
    IBV_MTU_256, IBV_QP_STATE, IBV_QPS_ERR, IBV_WC_REM_ACCESS_ERR, IBV_WC_SUCCESS, IBV_WR_RDMA_READ,
    IBV_WR_RDMA_WRITE, IBV_WR_SEND, ibv_mtu,
)
from softrdma.harness.replay import load_capture, replay_side
from softrdma.harness.sim import SimNetwork
from softrdma.harness.testing import Endpoint, connect, connected_pair
from softrdma.qp.responder import HELD_REQUESTS_MAX, READ_RESPONSE_BATCH
from softrdma.soft.capture import PacketCapture
from softrdma.verbs_api import Context, QPAttr, QPCap
from softrdma.wire.opcodes import Opcode as O
from softrdma.wire.packet import build, parse

from .conftest import wait_until
from .test_engine_seam import Wire, pair, send_wqe

_READ_RESPONSES = {int(O.RC_RDMA_READ_RESPONSE_FIRST), int(O.RC_RDMA_READ_RESPONSE_MIDDLE),
                   int(O.RC_RDMA_READ_RESPONSE_LAST), int(O.RC_RDMA_READ_RESPONSE_ONLY)}
_LAST = (int(O.RC_RDMA_READ_RESPONSE_LAST), int(O.RC_RDMA_READ_RESPONSE_ONLY))
CAP = QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=1, max_recv_sge=1)
MIB64 = 64 << 20
MTU4096 = dict(path_mtu=ibv_mtu.IBV_MTU_4096, timeout=14)  # 67 ms: a lost packet costs little


class Tap:
    """What a device transmits, as (opcode, destination QPN, PSN): a wrapper of its
    ``transmit`` (which drivers replace), so it sees each packet as it leaves the device."""

    def __init__(self, dev, keep: bool = True) -> None:
        self.sent: list[tuple[int, int, int]] = []
        self.raw: list[bytes] = []
        self.keep = keep
        inner = dev.transmit

        def tx(data: bytes, dst: bytes, sport: int) -> None:
            self.sent.append((data[0], int.from_bytes(data[5:8], "big"),
                              int.from_bytes(data[9:12], "big")))
            if self.keep:
                self.raw.append(bytes(data))
            inner(data, dst, sport)

        dev.transmit = tx

    def responses(self, qpn: int | None = None) -> int:
        return sum(1 for op, q, _ in self.sent if op in _READ_RESPONSES and qpn in (None, q))


def _sim_pair(net: SimNetwork, mr_size: int = 1 << 20):
    return connected_pair(net, "RC", mr_size=mr_size)  # path MTU 1024


def _run_passes(net: SimNetwork, tap: Tap, cond, bound: int, steps: int = 200_000) -> int:
    """Step ``net`` until ``cond()``; every step (one delivery, or one pass of the due
    timers and waiting responders) may make the responder send at most ``bound`` packets.
    Returns the largest number one step sent."""
    most = 0
    for _ in range(steps):
        if cond():
            return most
        before = len(tap.sent)
        assert net.step(), "the network went idle before the condition held"
        most = max(most, len(tap.sent) - before)
        assert most <= bound, f"one step sent {most} packets (bound {bound})"
    raise AssertionError("no end")


# -- live, on loopback ----------------------------------------------------------------------

def _live_pairs(udp_devices, base: str, thread: bool):
    da = udp_devices(f"{base}.1", f"rb-{base}-a", thread=thread)
    db = udp_devices(f"{base}.2", f"rb-{base}-b", thread=thread)
    a = Endpoint(Context(name=da.name), "RC", MIB64, CAP, 256)
    b = Endpoint(Context(name=db.name), "RC", MIB64, CAP, 256)
    connect(a, b, 100, 200, **MTU4096)
    connect(b, a, 200, 100, **MTU4096)
    a2 = Endpoint(a.ctx, "RC", 4096, CAP, 256)  # the other QP, on the same two devices
    b2 = Endpoint(b.ctx, "RC", 4096, CAP, 256)
    connect(a2, b2, 300, 400, **MTU4096)
    connect(b2, a2, 400, 300, **MTU4096)
    pattern = bytes(range(251)) * (MIB64 // 251 + 1)
    b.mr.write(pattern[:MIB64], MIB64, 0)
    return da, db, a, b, a2, b2


def test_a_64_mib_read_queues_a_batch_not_its_length(udp_devices):
    """Guards the memory bound: while a peer's 64 MiB READ (16,384 packets at MTU 4096) is
    answered by a live device, what its transport queues between two flushes
    (``UdpTransport.pending_peak``) stays within a couple of batches, and another QP's
    WRITE round trips keep completing meanwhile, each in bounded time. On main the whole
    response was queued at once: a peak of 16,384 packets (+66 MiB), and the other QP
    waited for all of them."""
    da, db, a, b, a2, b2 = _live_pairs(udp_devices, "127.0.43", thread=True)
    a.post_send(IBV_WR_RDMA_READ, a.sge(0, MIB64), wr_id=1, remote_offset=0)
    rtts = []
    end = time.monotonic() + 120
    while not len(a.cq) and time.monotonic() < end:
        t0 = time.monotonic()
        a2.post_send(IBV_WR_RDMA_WRITE, a2.sge(0, 64), wr_id=2, remote_offset=0)
        assert wait_until(lambda: len(a2.cq) > 0, 30), "the other QP's WRITE never completed"
        assert [w.status for w in a2.cq.poll_all()] == [IBV_WC_SUCCESS]
        rtts.append(time.monotonic() - t0)
    assert wait_until(lambda: len(a.cq) > 0, 1), "the 64 MiB READ did not complete in 120 s"
    assert [w.status for w in a.cq.poll_all()] == [IBV_WC_SUCCESS]
    assert a.mr.read(MIB64, 0) == b.mr.read(MIB64, 0)
    assert db.udp.pending_peak <= 2 * READ_RESPONSE_BATCH, db.udp.pending_peak
    # loose: a round trip waits for a few batches and a socket's backlog, never the READ
    assert rtts and max(rtts) < 10, rtts
    a2.close(), b2.close(), a.close(), b.close()


def test_another_qp_is_answered_in_the_middle_of_a_long_read(udp_devices):
    """Guards the latency bound, deterministically (manual devices on loopback, driven
    from this thread; tracemalloc around the responder's steps): a WRITE from another QP
    that reaches the responder while its 64 MiB READ response is under way is ACKed
    after at most two more batches of the READ, long before the READ's last packet, and
    no step of the responder allocates more than a few batches. On main the first step
    built the whole READ (tracemalloc peak about 66 MiB) and the WRITE was ACKed after
    it."""
    da, db, a, b, a2, b2 = _live_pairs(udp_devices, "127.0.44", thread=False)
    tap = Tap(db, keep=False)
    a.post_send(IBV_WR_RDMA_READ, a.sge(0, MIB64), wr_id=1, remote_offset=0)
    peak = 0

    def step_b() -> None:
        nonlocal peak
        tracemalloc.reset_peak()
        db.poll(0.001)
        peak = max(peak, tracemalloc.get_traced_memory()[1])

    tracemalloc.start()
    try:
        assert wait_until(lambda: (step_b(), tap.responses())[1] > 0, 10)
        a2.post_send(IBV_WR_RDMA_WRITE, a2.sge(0, 64), wr_id=2, remote_offset=0)
        at_post = tap.responses()
        ack_at = None
        end = time.monotonic() + 120
        while not len(a.cq) and time.monotonic() < end:
            step_b()
            if ack_at is None and any(q == a2.qp.qp_num for _, q, _ in tap.sent):
                ack_at = tap.responses()
            da.poll(0)
    finally:
        tracemalloc.stop()
    assert wait_until(lambda: (da.poll(0.001), len(a2.cq))[1] > 0, 10)
    assert [w.status for w in a2.cq.poll_all()] == [IBV_WC_SUCCESS]
    assert [w.status for w in a.cq.poll_all()] == [IBV_WC_SUCCESS]
    assert a.mr.read(MIB64, 0) == b.mr.read(MIB64, 0)
    assert ack_at is not None
    ops = [op for op, q, _ in tap.sent if op in _READ_RESPONSES]
    first_last = ops.index(int(O.RC_RDMA_READ_RESPONSE_LAST)) + 1
    assert ack_at - at_post <= 2 * READ_RESPONSE_BATCH, (at_post, ack_at)
    assert ack_at < first_last, "the WRITE was ACKed only after the READ's last packet"
    assert peak < 64 * READ_RESPONSE_BATCH * 4096, peak  # main: about 66 MiB
    a2.close(), b2.close(), a.close(), b.close()


# -- on the simulated network: each step is one delivery or one pass ------------------------

def test_a_request_behind_a_long_read_waits_for_its_response():
    """rxe's get_req: a request that arrives while a READ's response is under way waits
    until that response is complete, then executes in order. A WRITE posted right behind
    a 100-packet READ (within the requester's 128-PSN window, so it arrives during the
    response) is held, executed after the READ's LAST and ACKed; both complete; no step
    sends more than a batch (main: the READ's 100 packets in one step)."""
    net = SimNetwork(seed=3)
    a, b = _sim_pair(net)
    tap = Tap(b.device)
    size = 100 * 1024
    b.mr.write(bytes(i % 253 for i in range(size)), size, 0)
    a.mr.write(b"W" * 512, 512, size)
    a.post_send(IBV_WR_RDMA_READ, a.sge(0, size), wr_id=1, remote_offset=0)
    a.post_send(IBV_WR_RDMA_WRITE, a.sge(size, 512), wr_id=2, remote_offset=size)
    _run_passes(net, tap, lambda: a.ncomp() >= 2, READ_RESPONSE_BATCH + 1)
    assert [(w.wr_id, w.status) for w in a.cq.poll_all()] == [(1, 0), (2, 0)]
    assert a.mr.read(size, 0) == b.mr.read(size, 0)
    assert b.mr.read(512, size) == b"W" * 512
    ops = [op for op, q, _ in tap.sent if q == a.qp.qp_num]
    last = max(i for i, op in enumerate(ops) if op in _LAST)
    assert ops[last + 1:] == [int(O.RC_ACKNOWLEDGE)], ops[last - 2:]  # the WRITE's, after
    assert b.device.counters.drops.get("request_queue_full", 0) == 0


def test_a_duplicate_read_during_the_response_is_replayed_after_it():
    """A duplicate of the READ under way (the requester's retry) waits like any request,
    then is answered from the resources (replayed, not executed again), in batches too:
    the responder sends the response twice, the second one after the first is complete
    (main: both in one step each)."""
    net = SimNetwork(seed=4)
    a, b = _sim_pair(net)
    tap_b = Tap(b.device)
    tap_a = Tap(a.device)
    size = 4 * READ_RESPONSE_BATCH * 1024
    a.post_send(IBV_WR_RDMA_READ, a.sge(0, size), wr_id=1, remote_offset=0)
    _run_passes(net, tap_b, lambda: tap_b.responses() > 0, READ_RESPONSE_BATCH)
    (request,) = [r for r in tap_a.raw if r[0] == int(O.RC_RDMA_READ_REQUEST)]
    dup = b.device.counters.duplicate_request
    b.device.receive(request, a.device.ip_packed, b.device.ip_packed, verify_icrc=False)
    _run_passes(net, tap_b, lambda: tap_b.responses() >= 2 * (size // 1024),
                READ_RESPONSE_BATCH)
    assert b.device.counters.duplicate_request == dup + 1
    psns = [psn for op, _, psn in tap_b.sent if op in _READ_RESPONSES]
    n = size // 1024
    assert psns[:n] == psns[n:], "the replay is the same response, after the first"
    net.run_until(lambda: a.ncomp() > 0)
    assert [w.status for w in a.cq.poll_all()] == [IBV_WC_SUCCESS]
    assert a.mr.read(size, 0) == b.mr.read(size, 0)


def test_two_long_reads_share_the_responder_round_robin():
    """Two QPs' long READs on one responder device alternate batch by batch: neither
    waits for the other's whole response (main: the first READ's 256 packets, then the
    second's)."""
    net = SimNetwork(seed=5)
    a, b = _sim_pair(net)
    a2 = Endpoint(a.ctx, "RC", 1 << 20, CAP, 256)
    b2 = Endpoint(b.ctx, "RC", 1 << 20, CAP, 256)
    connect(a2, b2, 500, 600)
    connect(b2, a2, 600, 500)
    tap = Tap(b.device)
    size = 4 * READ_RESPONSE_BATCH * 1024
    a.post_send(IBV_WR_RDMA_READ, a.sge(0, size), wr_id=1, remote_offset=0)
    a2.post_send(IBV_WR_RDMA_READ, a2.sge(0, size), wr_id=2, remote_offset=0)
    _run_passes(net, tap, lambda: a.ncomp() and a2.ncomp(), 2 * READ_RESPONSE_BATCH)
    order = [q for op, q, _ in tap.sent if op in _READ_RESPONSES]
    runs, prev = [], None
    for q in order:
        if q != prev:
            runs.append(0)
            prev = q
        runs[-1] += 1
    assert max(runs) <= READ_RESPONSE_BATCH and len(runs) >= 8, runs
    assert [w.status for w in a.cq.poll_all() + a2.cq.poll_all()] == [0, 0]


def _start_long_read(seed: int):
    net = SimNetwork(seed=seed)
    a, b = _sim_pair(net)
    tap = Tap(b.device)
    size = 4 * READ_RESPONSE_BATCH * 1024
    a.post_send(IBV_WR_RDMA_READ, a.sge(0, size), wr_id=1, remote_offset=0)
    _run_passes(net, tap, lambda: tap.responses() > 0, READ_RESPONSE_BATCH)
    assert b.device.responders_waiting == 1
    return net, a, b, tap


def test_the_qp_moved_to_err_mid_read_sends_no_more():
    """The responder's QP moved to ERR while its READ's response is under way: the rest
    is not sent, the pass it asked for finds nothing to do, nothing faults."""
    net, a, b, tap = _start_long_read(6)
    b.qp.modify(QPAttr(qp_state=IBV_QPS_ERR), IBV_QP_STATE)
    sent = tap.responses()
    net.run(until=net.now + 0.001)
    assert tap.responses() == sent
    assert b.device.responders_waiting == 0 and b.device.counters.qp_fatal == 0


def test_the_qp_destroyed_mid_read_sends_no_more():
    """The responder's QP destroyed while its READ's response is under way: the device's
    pass skips it, nothing more is sent, nothing faults."""
    net, a, b, tap = _start_long_read(7)
    b.qp.close()
    sent = tap.responses()
    net.run(until=net.now + 0.001)
    assert tap.responses() == sent
    assert b.device.responders_waiting == 0 and b.device.counters.qp_fatal == 0


def test_the_mr_deregistered_mid_read_naks_at_the_next_batch():
    """The MR a READ reads from deregistered while its response is under way: the next
    batch finds the rkey gone, NAKs it (remote access error) and moves the QP to ERR, as
    the per-packet check always did; the requester's READ completes with
    IBV_WC_REM_ACCESS_ERR."""
    net, a, b, tap = _start_long_read(8)
    b.mr.close()
    net.run_until(lambda: a.ncomp() > 0)
    assert [w.status for w in a.cq.poll_all()][:1] == [IBV_WC_REM_ACCESS_ERR]
    assert tap.responses() == READ_RESPONSE_BATCH  # the batch before, none after
    assert tap.sent[READ_RESPONSE_BATCH][0] == int(O.RC_ACKNOWLEDGE)  # the NAK


def test_requests_beyond_the_held_bound_are_dropped_and_counted():
    """What a peer can make a responder hold behind a READ is bounded: beyond
    HELD_REQUESTS_MAX waiting requests (a requester's 128-PSN window) more are dropped
    and counted as ``request_queue_full``; the READ's response still completes."""
    net, a, b, tap = _start_long_read(9)
    for i in range(HELD_REQUESTS_MAX + 5):
        write = build(O.RC_RDMA_WRITE_ONLY, psn=(0x400000 + i) & 0xFFFFFF,
                      dest_qp=b.qp.qp_num, va=b.mr.buf, rkey=b.mr.rkey, dma_len=4,
                      payload=b"abcd")
        b.device.receive(bytes(write), a.device.ip_packed, b.device.ip_packed,
                         verify_icrc=False)
    assert b.device.counters.drops.get("request_queue_full") == 5
    net.run_until(lambda: a.ncomp() > 0)
    assert [w.status for w in a.cq.poll_all()][:1] == [IBV_WC_SUCCESS]


def test_a_capture_of_a_long_read_replays_identically(tmp_path):
    """``softrdma replay`` of a capture with a READ of 300 packets followed by a SEND:
    softrdma, standing in for either side, sends what the capture shows in its order, the
    responder's batches run to the end before the capture's next packet (as rxe's task
    did when it was captured). The capture is made on the simulated network, where no
    step may send more than a batch (main: the 300 packets in one step)."""
    net = SimNetwork(seed=11)
    a, b = _sim_pair(net)
    path = tmp_path / "long_read.pcap"
    cap = PacketCapture(str(path), clock=lambda: net.now)
    a.device.capture = cap
    tap = Tap(b.device, keep=False)
    size = 300 * 1024
    b.mr.write(bytes(i % 249 for i in range(size)), size, 0)
    b.post_recv(b.sge(size, 4096), wr_id=1)
    a.post_send(IBV_WR_RDMA_READ, a.sge(0, size), wr_id=2, remote_offset=0)
    a.post_send(IBV_WR_SEND, a.sge(size, 100), wr_id=3)
    _run_passes(net, tap, lambda: a.ncomp() >= 2 and b.ncomp() >= 1, READ_RESPONSE_BATCH + 1)
    cap.close()
    packets = load_capture(str(path))
    for ip in {packets[0].src, packets[0].dst}:
        res = replay_side(packets, ".".join(map(str, ip)), device_name="longread0")
        assert res.mismatches == [] and len(res.sent) == len(res.expected) > 0


class PassingWire(Wire):
    """The seam test's two fake DeviceServices, with ``schedule_responder``: the engines
    that ask wait in a list, and the link gives each ``run_responder()`` once no packet
    is in flight (a device's pass, round robin)."""

    def __init__(self) -> None:
        super().__init__()
        self.ready: list = []
        self.passes = 0

    def device(self, name: str):
        dev = super().device(name)
        dev.schedule_responder = lambda qp: qp in self.ready or self.ready.append(qp)
        return dev

    def run(self, limit: int = 10_000) -> None:
        """Deliver packets; when none is in flight, give the waiting responders a pass;
        when none waits either, jump the clock to the next timer (the seam test's)."""
        for _ in range(limit):
            if self.queue:
                eng, data = self.queue.pop(0)
                eng.on_packet(parse(data), b"")
            elif self.ready:
                ready, self.ready = self.ready, []
                self.passes += 1
                for qp in ready:
                    qp.run_responder()
            elif self.timers:
                q = min(self.timers, key=lambda e: e.deadline)
                self.now = q.deadline
                q.on_timer(self.now)
            else:
                return
        raise AssertionError("the exchange did not settle")


def test_the_engine_asks_for_passes_through_its_device_services():
    """The protocol core alone (no soft device): a 64 KiB READ at path MTU 256 (256
    response packets) is answered in passes the engine asks for with
    ``DeviceServices.schedule_responder`` and the device gives with
    ``QpEngine.run_responder``, a batch each, and completes with the right bytes (main:
    the engine never asks, all 256 packets leave inside the request's delivery)."""
    wire = PassingWire()
    a, b = pair(wire)
    for e in (a, b):
        e.eng.attr.path_mtu = IBV_MTU_256
    b.mr.buf[:] = bytes(i % 241 for i in range(len(b.mr.buf)))
    size = len(a.mr.buf)
    a.eng.sq.append(send_wqe(1, IBV_WR_RDMA_READ, a.mr, 0, size, remote=(b.mr, 0)))
    a.eng.kick()
    wire.run()
    assert [(w.wr_id, w.status) for w in a.scq.wcs] == [(1, IBV_WC_SUCCESS)]
    assert bytes(a.mr.buf) == bytes(b.mr.buf)
    assert wire.passes == size // 256 // READ_RESPONSE_BATCH - 1
    assert a.dev.counters.completer_retry_err == 0  # no pass came late enough to time out


def test_the_trace_says_where_a_read_paused_and_what_waited():
    """``softrdma trace`` (kind ``ack``) shows the READ pausing after a batch, with the PSN
    it resumes at, and the request that waited behind it (main: neither happened)."""
    out = io.StringIO()
    trace.enable("ack", stream=out)
    try:
        net = SimNetwork(seed=12)
        a, b = _sim_pair(net)
        a.post_send(IBV_WR_RDMA_READ, a.sge(0, 100 * 1024), wr_id=1, remote_offset=0)
        a.post_send(IBV_WR_RDMA_WRITE, a.sge(0, 100), wr_id=2, remote_offset=0)
        assert net.run_until(lambda: a.ncomp() >= 2)
    finally:
        trace.disable()
    text = out.getvalue()
    assert f"READ response paused at PSN {100 + READ_RESPONSE_BATCH} " in text, text[-2000:]
    assert "request PSN 200 waits: a READ's response is under way (1 held)" in text
