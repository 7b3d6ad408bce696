"""No timer a peer chooses holds CM state for long (issue 26 point 1, the CM's half).

The IB CM takes several timers from what the peer sends (cm.c): the REP's retransmit
interval is the REQ's ``local_cm_response_timeout``, TIMEWAIT and MRA waits derive from
the REQ's ``primary_local_ack_timeout`` (or the REP's ``target_ack_delay``), an MRA adds
its ``service_timeout``. Each is a 5-bit exponent: 31 is conv(31) = 2^23 ms = 2.3 h, so one
forged REQ accepted by the consumer held a half-open id for 16 x 2.3 h. softrdma cuts
the exponents at ``MAX_PEER_CM_TIMEOUT`` = 20 (rdma_cm's CMA_CM_RESPONSE_TIMEOUT, 4.096 s:
what rdma_cm asks of its own peers) and an MRA's at ``MAX_PEER_MRA_TIMEOUT`` = 24
(rdma_cm's own MRA setting). Every expected time below is derived here from those rules
(``conv(t) = 1 << (t - 8)`` ms), on a virtual clock.
"""

from __future__ import annotations

import errno

import pytest

from softrdma.cm.messages import (
    DREP, DREQ, MRA, REP, REQ, RTU, MsgResponse, build_cm, parse_cm,
)
from softrdma.cm.state import CmAgent, CmEventType as T, CmState as S
from softrdma.rdmacm import CMEvent, CMEventChannel, CMID, ConnParam
from softrdma.rdmacm import enums as ce
from softrdma.verbs_api import QPCap, QPInitAttr, add_device, remove_device
from softrdma.verbs_api.enums import ibv_qp_type

from .cm_forge import SERVER, Wire, deliver, forged_req, listening

E = ce.rdma_cm_event_type
CAP = 2 ** (20 - 8) / 1000  # conv(20) = 4.096 s: the longest peer-chosen interval
MRA_CAP = 2 ** (24 - 8) / 1000  # conv(24) = 65.536 s
SID = (0x0106 << 16) | 7471
PEER_GUID, PEER_COMM, PEER_QPN = 0x0200_00FF_FE00_0001, 0x0BAD_0001, 0x77


def approx(x: float) -> object:
    return pytest.approx(x, abs=1e-6)


class Host:
    """One CM agent on a virtual clock; what it sends and reports, with the time. The
    consumer answers as rdma_cm's would (REP to a REQ, RTU to a REP, DREP to a DREQ)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sent: list[tuple[float, str, object]] = []
        self.events: list[tuple[float, object]] = []
        self.agent = CmAgent(0x5254_00FF_FE00_0011, self._tx, self._on_event,
                             clock=lambda: self.now, id_operand=0x3FC95036, hi_tid=2)

    def _tx(self, mad: bytes, dest: object) -> None:
        self.sent.append((self.now, dest, parse_cm(mad)))

    def _on_event(self, ev) -> None:
        self.events.append((self.now, ev))
        a = self.agent
        if ev.type == T.REQ_RECEIVED:
            a.send_rep(ev.cm_id, local_qpn=0x22, starting_psn=1)
        elif ev.type == T.REP_RECEIVED:
            a.send_rtu(ev.cm_id)
        elif ev.type == T.DREQ_RECEIVED:
            a.send_drep(ev.cm_id)

    def run(self, until: float) -> None:
        """Fire every timer due up to ``until`` (the clock jumps from one to the next)."""
        while self.agent.deadline is not None and self.agent.deadline <= until:
            self.now = self.agent.deadline
            self.agent.on_timer(self.now)
        self.now = until

    def times(self, name: str) -> list[float]:
        return [t for t, _, m in self.sent if m.name == name]

    def at(self, etype: T) -> list[float]:
        return [t for t, ev in self.events if ev.type == etype]

    def last(self, name: str):
        return [m for _, _, m in self.sent if m.name == name][-1]


def peer_req(**fields) -> bytes:
    vals = dict(local_comm_id=PEER_COMM, service_id=SID, local_ca_guid=PEER_GUID,
                local_qpn=PEER_QPN, starting_psn=5, pkey=0xFFFF, path_mtu=3,
                remote_cm_response_timeout=20, local_cm_response_timeout=20,
                max_cm_retries=15, primary_local_ack_timeout=19, primary_hop_limit=64)
    vals.update(fields)
    return build_cm(REQ, tid=0x77, **vals)


def test_a_forged_reqs_response_timeout_31_gives_rep_resends_every_4096_ms():
    """local_cm_response_timeout = 31 and max_cm_retries = 15: the REP is resent every
    4.096 s (not every 2.3 h) and the id is gone, REP_ERROR, after 16 x 4.096 s."""
    h = Host()
    h.agent.listen(SID)
    h.agent.on_mad(peer_req(local_cm_response_timeout=31, max_cm_retries=15), "peer")
    h.run(1000.0)
    assert h.times("REP") == [approx(k * CAP) for k in range(16)]
    assert h.at(T.REP_ERROR) == [approx(16 * CAP)]  # 65.536 s
    req_ev = h.events[0][1]
    assert req_ev.cm_id.state == S.IDLE and h.agent.deadline is None


def test_timewait_from_a_forged_ack_timeout_31_lasts_at_most_4096_ms():
    """A REQ with primary_local_ack_timeout = 31 (the path's ACK timeout, which TIMEWAIT
    lasts): connected, then disconnected by the peer, the id leaves TIMEWAIT after
    conv(20) = 4.096 s, not conv(31) = 2.3 h."""
    h = Host()
    h.agent.listen(SID)
    h.agent.on_mad(peer_req(primary_local_ack_timeout=31), "peer")
    rep = h.last("REP")
    h.agent.on_mad(build_cm(RTU, tid=0x77, local_comm_id=PEER_COMM,
                            remote_comm_id=rep.local_comm_id), "peer")
    h.now = 1.0
    h.agent.on_mad(build_cm(DREQ, tid=0x78, local_comm_id=PEER_COMM,
                            remote_comm_id=rep.local_comm_id, remote_qpn=0x22), "peer")
    assert h.times("DREP") == [1.0]
    h.run(100_000.0)
    assert h.at(T.TIMEWAIT_EXIT) == [approx(1.0 + CAP)]


def test_an_mra_with_service_timeout_31_waits_at_most_rdma_cms_own_mra():
    """The peer MRAs our REP with service timeout 31: the REP's next resend waits
    conv(24) + conv(ACK timeout 19) = 67.584 s (rdma_cm's own MRA setting is honoured;
    31 would be 2.3 h per retry), so the id lives at most 16 x 67.584 s."""
    h = Host()
    h.agent.listen(SID)
    h.agent.on_mad(peer_req(), "peer")
    rep = h.last("REP")
    h.now = 1.0
    h.agent.on_mad(build_cm(MRA, tid=0x77, local_comm_id=PEER_COMM,
                            remote_comm_id=rep.local_comm_id,
                            message_mraed=MsgResponse.REP, service_timeout=31), "peer")
    wait = MRA_CAP + 2 ** (19 - 8) / 1000
    h.run(1.0 + 16 * wait + 1)
    assert h.times("REP") == [0.0] + [approx(1.0 + k * wait) for k in range(1, 16)]
    assert h.at(T.REP_ERROR) == [approx(1.0 + 16 * wait)]


def test_a_reps_target_ack_delay_31_does_not_stretch_our_timewait():
    """The active side: the peer's REP says target_ack_delay = 31, which makes the
    connection's ACK timeout 31; after our DREQ and its DREP, TIMEWAIT still ends
    conv(20) = 4.096 s later."""
    h = Host()
    cm_id = h.agent.create_id()
    h.agent.send_req(cm_id, dest="peer", service_id=SID, local_qpn=0x22, starting_psn=1)
    h.agent.on_mad(build_cm(REP, tid=h.last("REQ").tid, local_comm_id=PEER_COMM,
                            remote_comm_id=cm_id.local_id, local_qpn=PEER_QPN,
                            starting_psn=5, local_ca_guid=PEER_GUID,
                            target_ack_delay=31), "peer")
    assert cm_id.state == S.ESTABLISHED
    h.now = 2.0
    h.agent.send_dreq(cm_id)
    h.agent.on_mad(build_cm(DREP, tid=h.last("DREQ").tid, local_comm_id=PEER_COMM,
                            remote_comm_id=cm_id.local_id), "peer")
    assert cm_id.state == S.TIMEWAIT
    h.run(100_000.0)
    assert h.at(T.TIMEWAIT_EXIT) == [approx(2.0 + CAP)]


def test_rdma_cm_child_of_a_forged_req_is_unreachable_after_16_capped_resends():
    """rdma_cm end to end on a manual device (virtual clock): the application accepts a
    forged REQ whose local_cm_response_timeout is 31; the REP goes 16 times 4.096 s apart
    and then the child gets RDMA_CM_EVENT_UNREACHABLE with -ETIMEDOUT (cma.c: REP_ERROR),
    16 x 4.096 s = 65.5 s after the accept (before the cap: 16 x 2.3 h)."""
    dev = add_device(SERVER, name="cmlimits", live=False, mtu=1500)
    ch = CMEventChannel()
    try:
        lid = listening(ch, 8)
        wire = Wire(dev)
        deliver(dev, forged_req(0, local_cm_response_timeout=31, max_cm_retries=15))
        ev = CMEvent(ch, 5)
        assert ev.event_type == E.RDMA_CM_EVENT_CONNECT_REQUEST
        child = CMID(ev, listen_id=lid)
        child.create_qp(QPInitAttr(qp_type=ibv_qp_type.IBV_QPT_RC, cap=QPCap()))
        t0 = dev.now
        child.accept(ConnParam())
        ev = CMEvent(ch, 30)  # waiting moves the virtual clock through the resends
        assert ev.event_type == E.RDMA_CM_EVENT_UNREACHABLE
        assert ev.status == -errno.ETIMEDOUT
        assert dev.now - t0 == approx(16 * CAP)
        assert [t - t0 for t in wire.times("REP")] == [approx(k * CAP) for k in range(16)]
        child.close()
        lid.close()
    finally:
        ch.close()
        remove_device("cmlimits")
