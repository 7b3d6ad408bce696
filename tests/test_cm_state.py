"""The IB CM state machine (softrdma.cm.state) between two agents on a virtual clock.

Two :class:`CmAgent` are wired through a fake link that can drop or duplicate chosen
MADs; the clock only moves to the next timer. Every timing is derived here from Linux's
rules, not read back from the code (drivers/infiniband/core/cm.c):

* ``cm_convert_to_ms(t) = 1 << max(t - 8, 0)`` ms approximates 4.096 us x 2^t;
* REQ retransmission: ``2*conv(packet_life_time) + conv(remote_cm_response_timeout)``
  = 2*conv(18) + conv(20) = 2*1024 + 4096 = **6144 ms** with rdma_cm's RoCE values;
* REP retransmission: conv(the REQ's local CM response timeout 20) = **4096 ms**;
* a DREQ uses its id's timeout: 6144 ms from the active side, 4096 from the passive;
* up to max_cm_retries = 15 retransmissions, so 16 sends, and the error one timeout
  after the last;
* TIMEWAIT: conv(av timeout); the REQ's ACK timeout is cm_ack_timeout(15, 18) = 19
  (rxe's ACK delay 15, packet lifetime 18), so conv(19) = **2048 ms** on both sides;
* SIDR_REQ retransmission: rdma_cm's timeout_ms = 1 << (CMA_CM_RESPONSE_TIMEOUT 20 - 8)
  = **4096 ms**, max_cm_retries 15 (cma.c ``cma_resolve_ib_udp``), then SIDR_REQ_ERROR.
"""

from __future__ import annotations

from collections import deque

import pytest

from softrdma.cm.mad import new_tid
from softrdma.cm.messages import (
    REQ, SIDR_REP, MsgResponse, RejectReason, SidrStatus, build_cm, parse_cm,
)
from softrdma.cm.state import (
    ON_RECEIVE, ON_SEND_ERROR, USER_CALLS, CmAgent, CmEventType as E, CmState as S,
    CmStateError, cm_ack_timeout,
)

SID = (0x0106 << 16) | 7471  # rdma_cm TCP port space, port 7471
REQ_RTX = (2 * 2 ** (18 - 8) + 2 ** (20 - 8)) / 1000  # 6.144 s
REP_RTX = 2 ** (20 - 8) / 1000  # 4.096 s
TIMEWAIT = 2 ** (19 - 8) / 1000  # 2.048 s
SIDR_RTX = 2 ** (20 - 8) / 1000  # 4.096 s
USID = (0x0111 << 16) | 7174  # rdma_cm UDP port space, udaddy's port
RDMA_UDP_QKEY = 0x01234567
GUID_A, GUID_B = 0x5254_00FF_FE00_0012, 0x5254_00FF_FE00_0011
QPN_A, QPN_B = 0x21, 0x22


class Side:
    """One host: an agent, the events it reported (with the time), and a consumer that
    answers like rdma_cm (accept a REQ, RTU on a REP, DREP on a DREQ) unless told not to."""

    def __init__(self, net: "Net", name: str, guid: int, operand: int) -> None:
        self.net, self.name = net, name
        self.events: list[tuple[float, object]] = []
        self.accept = self.rtu = self.drep = True
        self.reject_with: bytes | None = None
        self.sidr_answer = True
        self.destroy_on_exit = False
        self.agent = CmAgent(guid, lambda mad, dest: net.send(name, dest, mad),
                             self.on_event, clock=lambda: net.now, id_operand=operand,
                             hi_tid=2)

    def on_event(self, ev) -> None:
        self.events.append((self.net.now, ev))
        if ev.type == E.REQ_RECEIVED:
            if self.reject_with is not None:
                self.agent.send_rej(ev.cm_id, RejectReason.CONSUMER_DEFINED,
                                    private_data=self.reject_with)
            elif self.accept:
                self.agent.send_rep(ev.cm_id, local_qpn=QPN_B, starting_psn=0xD50E68,
                                    responder_resources=1, initiator_depth=1,
                                    rnr_retry_count=7, private_data=b"rep-data")
        elif ev.type == E.REP_RECEIVED and self.rtu:
            self.agent.send_rtu(ev.cm_id)
        elif ev.type == E.DREQ_RECEIVED and self.drep:
            self.agent.send_drep(ev.cm_id)
        elif ev.type == E.SIDR_REQ_RECEIVED and self.sidr_answer:
            self.agent.send_sidr_rep(ev.cm_id, qpn=QPN_B, qkey=RDMA_UDP_QKEY,
                                     private_data=b"sidr-rep")
        elif ev.type == E.TIMEWAIT_EXIT and self.destroy_on_exit:
            self.agent.destroy(ev.cm_id)

    def types(self) -> list[E]:
        return [ev.type for _, ev in self.events]

    def at(self, etype: E) -> list[float]:
        return [t for t, ev in self.events if ev.type == etype]

    def event(self, etype: E):
        (ev,) = [ev for _, ev in self.events if ev.type == etype]
        return ev


class Net:
    """A lossless zero-latency link unless told to drop or duplicate the next N of a
    message; MADs are queued and delivered in order, never re-entrantly."""

    def __init__(self) -> None:
        self.now = 0.0
        self.queue: deque[tuple[str, str, bytes]] = deque()
        self.log: list[tuple[float, str, str]] = []  # (time, sender, message name)
        self.mads: list[tuple[float, str, bytes]] = []  # (time, sender, MAD), drops too
        self.drops: dict[str, int] = {}
        self.dups: dict[str, int] = {}
        self.a = Side(self, "A", GUID_A, 0x3FC95036)
        self.b = Side(self, "B", GUID_B, 0x0F409226)
        self.sides = {"A": self.a, "B": self.b}

    def send(self, src: str, dest: str, mad: bytes) -> None:
        name = parse_cm(mad).name
        self.log.append((self.now, src, name))
        self.mads.append((self.now, src, mad))
        if self.drops.get(name, 0):
            self.drops[name] -= 1
            return
        self.queue.append((src, dest, mad))
        if self.dups.get(name, 0):
            self.dups[name] -= 1
            self.queue.append((src, dest, mad))

    def sent(self, src: str, name: str) -> list[float]:
        return [t for t, s, n in self.log if s == src and n == name]

    def run(self, until: float) -> None:
        while True:
            while self.queue:
                src, dest, mad = self.queue.popleft()
                self.sides[dest].agent.on_mad(mad, src)
            deadlines = [d for d in (s.agent.deadline for s in self.sides.values())
                         if d is not None]
            if not deadlines or min(deadlines) > until:
                self.now = until
                return
            self.now = min(deadlines)
            for side in self.sides.values():
                if side.agent.deadline is not None and side.agent.deadline <= self.now:
                    side.agent.on_timer(self.now)

    def connect(self, **kw) -> object:
        self.b.agent.listen(SID)
        cm_id = self.a.agent.create_id()
        self.a.agent.send_req(cm_id, dest="B", service_id=SID, local_qpn=QPN_A,
                              starting_psn=0xBCCD43, responder_resources=1,
                              initiator_depth=1, retry_count=5, path_mtu=3,
                              private_data=b"req-data", **kw)
        return cm_id

    def resolve(self, **kw) -> object:
        """A SIDR_REQ from A to B's UD service (rdma_cm's timeouts unless given)."""
        cm_id = self.a.agent.create_id()
        self.a.agent.send_sidr_req(cm_id, dest="B", service_id=USID,
                                   private_data=b"sidr-req", **kw)
        return cm_id

    def sent_mads(self, src: str, name: str) -> list:
        return [m for _, s, mad in self.mads if s == src
                for m in [parse_cm(mad)] if m.name == name]


def established(net: Net):
    a_id = net.connect()
    net.run(0.5)
    (b_id,) = [c for c in net.b.agent.ids.values() if c.state != S.LISTEN]
    assert a_id.state == b_id.state == S.ESTABLISHED
    return a_id, b_id


def approx(x):
    return pytest.approx(x, abs=1e-9)


# ---- happy path ---------------------------------------------------------------------

def test_happy_path_req_rep_rtu_established():
    net = Net()
    a_id = net.connect()
    assert a_id.state == S.REQ_SENT
    net.run(0.5)
    assert [n for _, _, n in net.log] == ["REQ", "REP", "RTU"]
    assert net.a.types() == [E.REP_RECEIVED]
    assert net.b.types() == [E.REQ_RECEIVED, E.RTU_RECEIVED]
    b_id = net.b.event(E.REQ_RECEIVED).cm_id
    assert a_id.state == b_id.state == S.ESTABLISHED
    # comm IDs cross over, QPNs are learnt, private data arrives
    assert a_id.remote_id == b_id.local_id and b_id.remote_id == a_id.local_id
    assert a_id.remote_qpn == QPN_B and b_id.remote_qpn == QPN_A
    assert net.b.event(E.REQ_RECEIVED).private_data.rstrip(b"\0") == b"req-data"
    assert net.a.event(E.REP_RECEIVED).private_data.rstrip(b"\0") == b"rep-data"
    assert net.b.event(E.REQ_RECEIVED).listen_id.state == S.LISTEN
    # TIDs: the REQ's is Linux's (hi_tid << 32 | byte-swapped comm ID); REP/RTU echo it
    req = net.b.event(E.REQ_RECEIVED).message
    assert req.tid == new_tid(a_id.local_id, 2)
    assert net.a.event(E.REP_RECEIVED).message.tid == req.tid
    assert net.b.event(E.RTU_RECEIVED).message.tid == req.tid
    # the REQ carries rdma_cm's timers and the ACK timeout Linux computes (19)
    assert (req.remote_cm_response_timeout, req.local_cm_response_timeout,
            req.max_cm_retries, req.primary_local_ack_timeout) == (20, 20, 15, 19)
    # nothing is left running once established
    assert net.a.agent.deadline is None and net.b.agent.deadline is None


def test_cm_ack_timeout_matches_linux_rounding():
    # cm_ack_timeout(ack_delay, life): max(ack_delay, life+1), +1 if the other is within 50%
    assert cm_ack_timeout(15, 18) == 19  # the capture's value
    assert cm_ack_timeout(15, 14) == 16  # 15 vs 15: round up
    assert cm_ack_timeout(20, 10) == 20  # ack delay dominates, life+1=11 far below 19
    assert cm_ack_timeout(20, 18) == 21  # 19 >= 20-1: round up
    assert cm_ack_timeout(31, 31) == 31  # capped


# ---- losses recovered by retransmission ---------------------------------------------

def test_lost_req_is_retransmitted_after_6144_ms():
    net = Net()
    net.drops["REQ"] = 1
    net.connect()
    net.run(REQ_RTX - 0.001)
    assert net.sent("A", "REQ") == [0.0] and not net.b.events
    net.run(REQ_RTX + 0.5)
    assert net.sent("A", "REQ") == [0.0, approx(REQ_RTX)]
    assert net.b.types() == [E.REQ_RECEIVED, E.RTU_RECEIVED]
    assert net.a.types() == [E.REP_RECEIVED]


def test_lost_rep_is_retransmitted_after_4096_ms():
    net = Net()
    net.drops["REP"] = 1
    a_id = net.connect()
    net.run(REP_RTX + 0.5)
    assert net.sent("B", "REP") == [0.0, approx(REP_RTX)]
    # the REQ timer (6144 ms) did not fire before the REP came back
    assert net.sent("A", "REQ") == [0.0]
    assert a_id.state == S.ESTABLISHED
    assert net.b.at(E.RTU_RECEIVED) == [approx(REP_RTX)]


def test_lost_rtu_recovered_by_rep_retransmission_and_rtu_resend():
    net = Net()
    net.drops["RTU"] = 1
    a_id = net.connect()
    net.run(0.5)
    b_id = net.b.event(E.REQ_RECEIVED).cm_id
    assert a_id.state == S.ESTABLISHED and b_id.state == S.REP_SENT
    net.run(REP_RTX + 0.5)
    # B resends the REP at 4096 ms; A, ESTABLISHED, answers the duplicate with the RTU
    assert net.sent("B", "REP") == [0.0, approx(REP_RTX)]
    assert net.sent("A", "RTU") == [0.0, approx(REP_RTX)]
    assert b_id.state == S.ESTABLISHED
    assert net.a.types() == [E.REP_RECEIVED]  # the duplicate REP is no new event
    assert net.a.agent.counters["rx_duplicates"]["REP"] == 1


def test_lost_dreq_is_retransmitted_with_the_ids_timeout():
    for sender, interval in (("a", REQ_RTX), ("b", REP_RTX)):
        net = Net()
        a_id, b_id = established(net)
        t0 = net.now
        net.drops["DREQ"] = 1
        me, peer = (net.a, net.b) if sender == "a" else (net.b, net.a)
        me.agent.send_dreq(a_id if sender == "a" else b_id)
        net.run(t0 + interval + 0.1)
        name = me.name
        assert net.sent(name, "DREQ") == [approx(t0), approx(t0 + interval)]
        assert peer.at(E.DREQ_RECEIVED) == [approx(t0 + interval)]
        assert me.at(E.DREP_RECEIVED) == [approx(t0 + interval)]


def test_lost_drep_resent_from_timewait():
    # The passive side's DREQ waits conv(REQ local CM response timeout): 10 -> 4 ms,
    # shorter than A's 2048 ms TIMEWAIT, so the retransmitted DREQ finds A in TIMEWAIT
    net = Net()
    net.connect(local_cm_response_timeout=10)
    net.run(0.5)
    a_id = net.a.event(E.REP_RECEIVED).cm_id
    b_id = net.b.event(E.REQ_RECEIVED).cm_id
    t0 = net.now
    net.drops["DREP"] = 1
    net.b.agent.send_dreq(b_id)
    net.run(t0 + 0.001)
    assert a_id.state == S.TIMEWAIT and b_id.state == S.DREQ_SENT
    net.run(t0 + 0.1)
    step = 2 ** (10 - 8) / 1000
    assert net.sent("B", "DREQ") == [approx(t0), approx(t0 + step)]
    assert net.sent("A", "DREP") == [approx(t0), approx(t0 + step)]
    assert net.a.types().count(E.DREQ_RECEIVED) == 1  # the duplicate is no new event
    assert net.b.at(E.DREP_RECEIVED) == [approx(t0 + step)]
    assert net.a.agent.counters["rx_duplicates"]["DREQ"] == 1


def test_lost_drep_after_timewait_answered_once_the_id_is_gone():
    # With rdma_cm's timers the DREQ comes back (6144 ms) after B's TIMEWAIT (2048 ms).
    # Linux answers a DREQ that matches no id with a DREP (cm_issue_drep), so once B's
    # consumer destroyed the id the retransmission still completes the disconnect.
    net = Net()
    a_id, b_id = established(net)
    t0 = net.now
    net.drops["DREP"] = 1
    net.b.destroy_on_exit = True
    net.a.agent.send_dreq(a_id)
    net.run(t0 + REQ_RTX + 0.1)
    assert net.b.at(E.TIMEWAIT_EXIT) == [approx(t0 + TIMEWAIT)]
    assert b_id.local_id not in net.b.agent.ids
    assert net.sent("A", "DREQ") == [approx(t0), approx(t0 + REQ_RTX)]
    assert net.sent("B", "DREP") == [approx(t0), approx(t0 + REQ_RTX)]
    assert net.a.at(E.DREP_RECEIVED) == [approx(t0 + REQ_RTX)]
    assert a_id.state == S.TIMEWAIT


def test_dreq_to_an_idle_id_is_dropped_as_linux_does():
    # ...but while the id still exists in IDLE (after TIMEWAIT_EXIT, not destroyed),
    # cm_dreq_handler drops the DREQ: the sender ends with DREQ_ERROR.
    net = Net()
    a_id, b_id = established(net)
    t0 = net.now
    net.drops["DREP"] = 1
    net.a.agent.send_dreq(a_id)
    net.run(t0 + 17 * REQ_RTX)
    assert net.sent("B", "DREP") == [approx(t0)]
    assert net.a.at(E.DREQ_ERROR) == [approx(t0 + 16 * REQ_RTX)]


# ---- duplicates ---------------------------------------------------------------------

def test_duplicate_req_is_ignored_while_the_rep_is_pending():
    net = Net()
    net.dups["REQ"] = 1
    net.connect()
    net.run(0.5)
    assert net.sent("B", "REP") == [0.0]  # Linux does not answer a duplicate REQ with a REP
    assert net.b.types() == [E.REQ_RECEIVED, E.RTU_RECEIVED]
    assert net.b.agent.counters["rx_duplicates"]["REQ"] == 1
    assert len([c for c in net.b.agent.ids.values() if c.state != S.LISTEN]) == 1


def test_duplicate_req_after_delayed_mra_gets_the_mra():
    net = Net()
    net.b.accept = False
    net.dups["REQ"] = 1
    a_id = net.connect()
    # rdma_cm's behaviour: MRA with the delay flag on REQ arrival; sent on a duplicate
    orig = net.b.on_event

    def on_event(ev):
        orig(ev)
        if ev.type == E.REQ_RECEIVED:
            net.b.agent.send_mra(ev.cm_id, 0x80 | 24)
    net.b.agent.on_event = on_event
    net.run(0.1)
    assert net.sent("B", "MRA") == [0.0]  # only because of the duplicate
    mra_ev = net.a.event(E.MRA_RECEIVED)
    assert mra_ev.service_timeout == 24
    assert a_id.state == S.MRA_REQ_RCVD
    # the REQ timer now waits conv(24) + conv(av timeout 19) ms before retrying, and the
    # retries keep that interval (ib_modify_mad); each duplicate REQ gets the MRA again
    wait = (2 ** (24 - 8) + 2 ** (19 - 8)) / 1000  # 67.584 s
    net.run(2 * wait + 0.001)
    assert net.sent("A", "REQ") == [0.0, approx(wait), approx(2 * wait)]  # link dup'd the 1st
    assert net.sent("B", "MRA") == [0.0, approx(wait), approx(2 * wait)]
    assert a_id.state == S.MRA_REQ_RCVD  # a second MRA is a duplicate, no new event
    assert net.a.types() == [E.MRA_RECEIVED]


def test_duplicate_rep_gets_the_rtu_again():
    net = Net()
    net.dups["REP"] = 1
    a_id = net.connect()
    net.run(0.5)
    assert net.sent("A", "RTU") == [0.0, 0.0]
    assert net.a.types() == [E.REP_RECEIVED]
    assert net.b.types() == [E.REQ_RECEIVED, E.RTU_RECEIVED]  # the second RTU is dropped
    assert a_id.state == S.ESTABLISHED


# ---- rejects ------------------------------------------------------------------------

def test_req_without_listener_gets_rej_invalid_service_id():
    net = Net()
    cm_id = net.a.agent.create_id()
    net.a.agent.send_req(cm_id, dest="B", service_id=SID + 1, local_qpn=QPN_A,
                         starting_psn=1)
    net.run(0.5)
    ev = net.a.event(E.REJ_RECEIVED)
    assert ev.reason == RejectReason.INVALID_SERVICE_ID == 8
    assert ev.message.message_rejected == MsgResponse.REQ
    assert ev.message.remote_comm_id == cm_id.local_id and ev.message.local_comm_id == 0
    assert cm_id.state == S.IDLE and net.a.agent.deadline is None
    assert net.b.events == [] and len(net.b.agent.ids) == 0


def test_consumer_reject_with_private_data_reaches_the_active_side():
    net = Net()
    net.b.reject_with = b"go away"
    a_id = net.connect()
    net.run(0.5)
    ev = net.a.event(E.REJ_RECEIVED)
    assert ev.reason == RejectReason.CONSUMER_DEFINED == 28
    assert ev.private_data[:7] == b"go away" and len(ev.private_data) == 148
    assert a_id.state == S.IDLE
    b_id = net.b.event(E.REQ_RECEIVED).cm_id
    assert b_id.state == S.IDLE
    # nothing retries afterwards
    net.run(200.0)
    assert net.sent("A", "REQ") == [0.0]


def test_stale_connection_rej_and_dreq_to_the_old_connection():
    net = Net()
    a_id, b_id = established(net)
    # A second REQ from the same (QPN, CA GUID) while the first connection lives
    other = net.a.agent.create_id()
    net.a.agent.send_req(other, dest="B", service_id=SID, local_qpn=QPN_A,
                         starting_psn=2)
    net.run(net.now + 0.1)
    ev = [e for _, e in net.a.events if e.type == E.REJ_RECEIVED][0]
    assert ev.reason == RejectReason.STALE_CONN and ev.cm_id is other
    assert other.state == S.TIMEWAIT  # REJ 10 in REQ_SENT leads to TIMEWAIT
    assert E.DREQ_RECEIVED in net.a.types()  # B tore down the old connection


# ---- timeouts -----------------------------------------------------------------------

def test_req_times_out_after_15_retries():
    net = Net()
    net.drops["REQ"] = 100
    a_id = net.connect()
    net.run(1000.0)
    sends = net.sent("A", "REQ")
    assert sends == [approx(k * REQ_RTX) for k in range(16)]
    assert net.a.types() == [E.REQ_ERROR]
    assert net.a.at(E.REQ_ERROR) == [approx(16 * REQ_RTX)]  # 98.304 s
    assert a_id.state == S.IDLE and net.a.agent.deadline is None


def test_rep_times_out_to_rep_error():
    net = Net()
    net.drops["REP"] = 100
    a_id = net.connect()
    end = 16 * REP_RTX  # 65.536 s
    net.run(end + 0.001)
    assert net.sent("B", "REP") == [approx(k * REP_RTX) for k in range(16)]
    assert net.b.at(E.REP_ERROR) == [approx(end)]
    b_id = net.b.event(E.REQ_RECEIVED).cm_id
    assert b_id.state == S.IDLE
    # A kept retrying its REQ every 6144 ms; those before the error were duplicates
    req_times = [k * REQ_RTX for k in range(11)]  # 0 .. 61.44 s
    assert net.sent("A", "REQ") == [approx(t) for t in req_times]
    assert net.b.agent.counters["rx_duplicates"]["REQ"] == 10
    assert a_id.state == S.REQ_SENT
    # the next one (67.584 s) is a new REQ to B: the reset id no longer claims it
    net.run(11 * REQ_RTX + 0.001)
    assert net.b.at(E.REQ_RECEIVED) == [0.0, approx(11 * REQ_RTX)]


def test_dreq_times_out_to_dreq_error_then_timewait():
    net = Net()
    a_id, b_id = established(net)
    t0 = net.now
    net.drops["DREQ"] = 100
    net.a.agent.send_dreq(a_id)
    net.run(t0 + 16 * REQ_RTX + 0.001)
    assert net.a.at(E.DREQ_ERROR) == [approx(t0 + 16 * REQ_RTX)]
    assert a_id.state == S.TIMEWAIT
    net.run(t0 + 16 * REQ_RTX + TIMEWAIT + 0.001)
    assert net.a.at(E.TIMEWAIT_EXIT) == [approx(t0 + 16 * REQ_RTX + TIMEWAIT)]


# ---- disconnect ---------------------------------------------------------------------

def test_disconnect_timewait_then_timewait_exit_after_2048_ms():
    net = Net()
    a_id, b_id = established(net)
    t0 = net.now
    net.a.agent.send_dreq(a_id)
    net.run(t0 + TIMEWAIT - 0.001)
    assert a_id.state == b_id.state == S.TIMEWAIT
    assert net.a.at(E.DREP_RECEIVED) == [approx(t0)]
    net.run(t0 + 10)
    assert net.a.at(E.TIMEWAIT_EXIT) == [approx(t0 + TIMEWAIT)]
    assert net.b.at(E.TIMEWAIT_EXIT) == [approx(t0 + TIMEWAIT)]
    assert a_id.state == b_id.state == S.IDLE
    assert net.a.agent.deadline is None and net.b.agent.deadline is None


def test_simultaneous_disconnect():
    net = Net()
    a_id, b_id = established(net)
    t0 = net.now
    net.a.agent.send_dreq(a_id)
    net.b.agent.send_dreq(b_id)
    net.run(t0 + 60)
    # each DREQ is received in DREQ_SENT, cancels the local DREQ and is answered
    assert net.a.types()[-2:] == [E.DREQ_RECEIVED, E.TIMEWAIT_EXIT]
    assert net.b.types()[-2:] == [E.DREQ_RECEIVED, E.TIMEWAIT_EXIT]
    assert net.sent("A", "DREQ") == [approx(t0)] and net.sent("B", "DREQ") == [approx(t0)]
    assert net.a.at(E.TIMEWAIT_EXIT) == [approx(t0 + TIMEWAIT)]
    assert E.DREQ_ERROR not in net.a.types() + net.b.types()


def test_dreq_for_unknown_connection_gets_a_drep():
    net = Net()
    raw = build_cm("DREQ", tid=7, local_comm_id=0x1234, remote_comm_id=0x5678,
                   remote_qpn=QPN_B)
    net.b.agent.on_mad(raw, "A")
    (src, dest, mad) = net.queue.popleft()
    drep = parse_cm(mad)
    assert (src, dest, drep.name, drep.tid) == ("B", "A", "DREP", 7)
    assert (drep.local_comm_id, drep.remote_comm_id) == (0x5678, 0x1234)


def test_dreq_with_the_wrong_qpn_is_dropped():
    net = Net()
    a_id, b_id = established(net)
    raw = build_cm("DREQ", tid=7, local_comm_id=a_id.local_id, remote_comm_id=b_id.local_id,
                   remote_qpn=QPN_B + 1)
    net.b.agent.on_mad(raw, "A")
    assert b_id.state == S.ESTABLISHED and not net.queue


# ---- user calls and the tables ------------------------------------------------------

def test_user_calls_in_the_wrong_state_raise():
    net = Net()
    cm_id = net.a.agent.create_id()
    for call in ("send_rtu", "send_dreq", "send_drep", "send_rej", "establish"):
        with pytest.raises(CmStateError):
            getattr(net.a.agent, call)(cm_id)
    net.b.agent.listen(SID)
    with pytest.raises(CmStateError):
        net.b.agent.listen(SID)


def test_tables_agree_with_linux_for_the_key_transitions():
    # spot checks against cm.c, written from the kernel source, not from the tables
    assert USER_CALLS["send_rep"] == {S.REQ_RCVD: S.REP_SENT, S.MRA_REQ_SENT: S.REP_SENT}
    assert USER_CALLS["send_rej"][S.REP_SENT] == S.TIMEWAIT
    assert USER_CALLS["send_rej"][S.REQ_RCVD] == S.IDLE
    assert ON_RECEIVE["REJ"][S.ESTABLISHED] == S.TIMEWAIT
    assert ON_RECEIVE["DREQ"][S.DREQ_SENT] == S.DREQ_RCVD
    assert S.TIMEWAIT not in ON_RECEIVE["DREQ"]  # handled as a duplicate, DREP resent
    assert int(S.TIMEWAIT) == 13 and int(E.TIMEWAIT_EXIT) == 9


def test_establish_on_first_data_before_the_rtu():
    net = Net()
    net.drops["RTU"] = 1
    net.connect()
    net.run(0.1)
    b_id = net.b.event(E.REQ_RECEIVED).cm_id
    net.b.agent.establish(b_id)
    assert b_id.state == S.ESTABLISHED and net.b.types()[-1] == E.USER_ESTABLISHED
    assert net.b.agent.deadline is None  # the REP is no longer retransmitted


def test_garbage_is_counted_and_ignored():
    net = Net()
    net.b.agent.on_mad(b"\0" * 10, "A")
    bad = bytearray(build_cm(REQ, tid=1, local_comm_id=1))
    bad[2] = 1  # class version 1
    net.b.agent.on_mad(bytes(bad), "A")
    assert net.b.agent.counters["dropped"] == {"mad_size": 1, "class_version": 1}
    assert not net.queue


# ---- SIDR (service ID resolution, the UD path: cm.c ib_send_cm_sidr_req & co.) -------

def test_sidr_resolution_delivers_the_services_qpn_and_qkey():
    net = Net()
    net.b.agent.listen(USID)
    a_id = net.resolve()
    assert a_id.state == S.SIDR_REQ_SENT
    net.run(0.5)
    assert [n for _, _, n in net.log] == ["SIDR_REQ", "SIDR_REP"]
    # the SIDR_REQ: request ID = the requester's comm ID, P_Key 0xFFFF, a fresh TID
    ev_b = net.b.event(E.SIDR_REQ_RECEIVED)
    req = ev_b.message
    assert (req.request_id, req.pkey, req.service_id) == (a_id.local_id, 0xFFFF, USID)
    assert req.tid == new_tid(a_id.local_id, 2)
    assert ev_b.private_data.rstrip(b"\0") == b"sidr-req"
    assert ev_b.listen_id.state == S.LISTEN and ev_b.source == "A"
    # the SIDR_REP echoes request ID, service ID and TID and carries the UD QP
    ev_a = net.a.event(E.SIDR_REP_RECEIVED)
    rep = ev_a.message
    assert ev_a.cm_id is a_id and ev_a.status == rep.status == SidrStatus.SUCCESS
    assert (rep.request_id, rep.service_id, rep.tid) == (a_id.local_id, USID, req.tid)
    assert (rep.qpn, rep.qkey) == (QPN_B, RDMA_UDP_QKEY)
    assert ev_a.private_data.rstrip(b"\0") == b"sidr-rep"
    # both ids back in IDLE, nothing left running
    assert a_id.state == ev_b.cm_id.state == S.IDLE
    assert net.a.agent.deadline is None and net.b.agent.deadline is None
    assert net.a.types() == [E.SIDR_REP_RECEIVED]
    assert net.b.types() == [E.SIDR_REQ_RECEIVED]


def test_sidr_req_without_listener_gets_status_unsupported():
    net = Net()
    a_id = net.resolve()
    net.run(0.5)
    assert [n for _, _, n in net.log] == ["SIDR_REQ", "SIDR_REP"]
    ev = net.a.event(E.SIDR_REP_RECEIVED)
    assert ev.status == ev.message.status == SidrStatus.UNSUPPORTED == 1
    assert ev.message.request_id == a_id.local_id and ev.message.service_id == USID
    assert ev.message.tid == new_tid(a_id.local_id, 2)
    assert not net.b.events and not net.b.agent.ids  # no id stays on B
    assert a_id.state == S.IDLE and net.a.agent.deadline is None


def test_lost_sidr_req_is_retransmitted_after_4096_ms_with_the_same_tid():
    net = Net()
    net.b.agent.listen(USID)
    net.drops["SIDR_REQ"] = 1
    net.resolve()
    net.run(SIDR_RTX - 0.001)
    assert net.sent("A", "SIDR_REQ") == [0.0] and not net.b.events
    net.run(SIDR_RTX + 0.5)
    assert net.sent("A", "SIDR_REQ") == [0.0, approx(SIDR_RTX)]
    first, second = net.sent_mads("A", "SIDR_REQ")
    assert first.tid == second.tid and first.request_id == second.request_id
    assert net.a.types() == [E.SIDR_REP_RECEIVED]
    assert net.a.event(E.SIDR_REP_RECEIVED).message.tid == first.tid
    assert net.a.agent.counters["tx_retries"] == {"SIDR_REQ": 1}


def test_sidr_req_times_out_after_15_retries_to_sidr_req_error():
    net = Net()
    net.b.agent.listen(USID)
    net.drops["SIDR_REQ"] = 100
    a_id = net.resolve()
    net.run(1000.0)
    sends = net.sent("A", "SIDR_REQ")
    assert len(sends) == 1 + 15
    assert sends == [approx(k * SIDR_RTX) for k in range(16)]
    assert len({m.tid for m in net.sent_mads("A", "SIDR_REQ")}) == 1
    assert net.a.types() == [E.SIDR_REQ_ERROR]
    assert net.a.at(E.SIDR_REQ_ERROR) == [approx(16 * SIDR_RTX)]  # 65.536 s
    assert net.a.event(E.SIDR_REQ_ERROR).send_status == "timeout"
    assert a_id.state == S.IDLE and net.a.agent.deadline is None
    assert net.a.agent.counters["tx_retries"]["SIDR_REQ"] == 15


def test_sidr_req_timeout_and_retries_are_the_callers():
    net = Net()
    net.drops["SIDR_REQ"] = 100
    net.resolve(timeout_ms=100, max_cm_retries=2)
    net.run(10.0)
    assert net.sent("A", "SIDR_REQ") == [0.0, approx(0.1), approx(0.2)]
    assert net.a.at(E.SIDR_REQ_ERROR) == [approx(0.3)]


def test_duplicate_sidr_req_is_dropped_while_being_processed():
    net = Net()
    net.b.agent.listen(USID)
    net.b.sidr_answer = False  # B's consumer has not answered yet
    net.dups["SIDR_REQ"] = 1
    a_id = net.resolve()
    net.run(0.1)
    assert net.b.types() == [E.SIDR_REQ_RECEIVED]
    assert net.b.agent.counters["rx_duplicates"] == {"SIDR_REQ": 1}
    b_ids = [c for c in net.b.agent.ids.values() if c.state == S.SIDR_REQ_RCVD]
    assert len(b_ids) == 1
    # the same request ID from another source is a different request
    raw = net.sent_mads("A", "SIDR_REQ")[0].pack()
    net.b.agent.on_mad(raw, "C")
    assert net.b.types() == [E.SIDR_REQ_RECEIVED] * 2
    assert net.b.agent.counters["rx_duplicates"] == {"SIDR_REQ": 1}
    # once answered the id no longer claims the request: the same SIDR_REQ is new again
    net.b.agent.send_sidr_rep(b_ids[0], qpn=QPN_B, qkey=RDMA_UDP_QKEY)
    net.run(0.2)
    assert a_id.state == S.IDLE
    net.b.agent.on_mad(raw, "A")
    assert net.b.types() == [E.SIDR_REQ_RECEIVED] * 3
    assert net.b.agent.counters["rx_duplicates"] == {"SIDR_REQ": 1}


def test_destroy_in_sidr_req_rcvd_answers_status_reject():
    net = Net()
    net.b.agent.listen(USID)
    net.b.sidr_answer = False
    a_id = net.resolve()
    net.run(0.1)
    b_id = net.b.event(E.SIDR_REQ_RECEIVED).cm_id
    assert b_id.state == S.SIDR_REQ_RCVD
    net.b.agent.destroy(b_id)
    net.run(0.2)
    assert b_id.local_id not in net.b.agent.ids
    ev = net.a.event(E.SIDR_REP_RECEIVED)
    assert ev.status == SidrStatus.REJECT == 2
    assert ev.message.request_id == a_id.local_id and ev.message.service_id == USID
    assert a_id.state == S.IDLE and net.a.agent.deadline is None


def test_destroy_in_sidr_req_sent_cancels_the_retransmission():
    net = Net()
    net.drops["SIDR_REQ"] = 100
    a_id = net.resolve()
    net.a.agent.destroy(a_id)
    assert net.a.agent.deadline is None
    net.run(100.0)
    assert net.sent("A", "SIDR_REQ") == [0.0] and not net.a.events


def test_unmatched_sidr_rep_is_dropped_and_counted():
    net = Net()
    # no id with that comm ID
    net.a.agent.on_mad(build_cm(SIDR_REP, tid=7, request_id=0x1234, service_id=USID),
                       "B")
    assert net.a.agent.counters["dropped"] == {"unmatched_sidr_rep": 1}
    # a second copy of a SIDR_REP once the id is back in IDLE
    net.b.agent.listen(USID)
    a_id = net.resolve()
    net.run(0.1)
    (rep_mad,) = [mad for _, s, mad in net.mads if s == "B"]
    net.a.agent.on_mad(rep_mad, "B")
    # a SIDR_REP naming an id that sent a REQ, not a SIDR_REQ
    c_id = net.a.agent.create_id()
    net.drops["REQ"] = 100
    net.a.agent.send_req(c_id, dest="B", service_id=USID, local_qpn=QPN_A,
                         starting_psn=1)
    net.a.agent.on_mad(build_cm(SIDR_REP, tid=7, request_id=c_id.local_id,
                                service_id=USID), "B")
    assert net.a.agent.counters["dropped"] == {"unmatched_sidr_rep": 3}
    assert net.a.types() == [E.SIDR_REP_RECEIVED]  # only the real one
    assert a_id.state == S.IDLE and c_id.state == S.REQ_SENT
    assert not net.queue


def test_sidr_calls_in_the_wrong_state_raise_and_the_tables_agree_with_linux():
    net = Net()
    cm_id = net.a.agent.create_id()
    with pytest.raises(CmStateError):
        net.a.agent.send_sidr_rep(cm_id)
    net.a.agent.send_sidr_req(cm_id, dest="B", service_id=USID)
    with pytest.raises(CmStateError):
        net.a.agent.send_sidr_req(cm_id, dest="B", service_id=USID)
    # written from cm.c (ib_send_cm_sidr_req, cm_send_sidr_rep_locked,
    # cm_sidr_rep_handler, cm_process_send_error), not from the tables
    assert USER_CALLS["send_sidr_req"] == {S.IDLE: S.SIDR_REQ_SENT}
    assert USER_CALLS["send_sidr_rep"] == {S.SIDR_REQ_RCVD: S.IDLE}
    assert ON_RECEIVE["SIDR_REP"] == {S.SIDR_REQ_SENT: S.IDLE}
    assert ON_SEND_ERROR[S.SIDR_REQ_SENT] == (S.IDLE, E.SIDR_REQ_ERROR)
    assert int(S.SIDR_REQ_SENT) == 14 and int(E.SIDR_REP_RECEIVED) == 17
