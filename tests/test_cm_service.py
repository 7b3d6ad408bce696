"""The CM on a live soft device (softrdma.soft.cm_service, docs/cm.md "The CM on a device"):
two devices on 127.0.44.x connect, disconnect and time out over real UDP, with the
progress threads running the agents' retransmission and TIMEWAIT timers."""

from __future__ import annotations

import ipaddress
import queue
import time

import pytest

from softrdma.cm.cma import CmaHeader, PortSpace, cma_private_data, service_id, \
    split_cma_private_data
from softrdma.cm.messages import SIDR_REQ, RejectReason, SidrStatus
from softrdma.cm.state import CmEventType as E, CmState
from softrdma.counters import Drop
from softrdma.soft.cm_service import CmService
from softrdma.verbs_api import Context, add_device, remove_device

A_IP, B_IP = "127.0.44.1", "127.0.44.2"
SID = service_id(PortSpace.TCP, 7471)
USID = service_id(PortSpace.UDP, 7174)  # udaddy
RDMA_UDP_QKEY = 0x01234567
#: Short timeouts carried by the REQ so a lost message costs ~0.26 s, not Linux's ~6 s:
#: packet lifetime 8 (conv = 1 ms) and CM response timeouts 16 (conv = 256 ms): REQ
#: retransmitted every 2*1 + 256 ms, REP every 256 ms; TIMEWAIT conv(15) = 128 ms.
FAST = dict(packet_life_time=8, remote_cm_response_timeout=16, local_cm_response_timeout=16)


@pytest.fixture
def pair():
    add_device(A_IP, name="cm-a")
    add_device(B_IP, name="cm-b")
    try:
        with Context(name="cm-a") as ca, Context(name="cm-b") as cb:
            a, b = CmService(ca.device), CmService(cb.device)
            try:
                yield a, b
            finally:
                a.close()
                b.close()
    finally:
        remove_device("cm-a")
        remove_device("cm-b")


def next_event(svc: CmService, timeout: float = 5.0):
    return svc.get_event(timeout=timeout)


def req_private_data(user: bytes = b"hi") -> bytes:
    hdr = CmaHeader(ipaddress.ip_address(A_IP), ipaddress.ip_address(B_IP), 40000)
    return cma_private_data(hdr, user)


def connect(a: CmService, b: CmService, **req):
    """REQ, REP, RTU through the event queues; returns (a's id, b's id, b's REQ event)."""
    b.listen(SID)
    ca = a.connect(B_IP, service_id=SID, local_qpn=0x111, starting_psn=0xAAA,
                   private_data=req_private_data(), **{**FAST, **req})
    ev = next_event(b)
    assert ev.type == E.REQ_RECEIVED
    cb = ev.cm_id
    b.accept(cb, local_qpn=0x222, starting_psn=0xBBB, private_data=b"rep")
    ev_a = next_event(a)
    assert ev_a.type == E.REP_RECEIVED and ev_a.cm_id is ca
    assert ev_a.message.local_qpn == 0x222 and ev_a.message.starting_psn == 0xBBB
    assert ev_a.private_data[:3] == b"rep"
    a.ready_to_use(ca, b"rtu")
    ev_b = next_event(b)
    assert ev_b.type == E.RTU_RECEIVED and ev_b.cm_id is cb
    return ca, cb, ev


def test_connect_disconnect_and_timewait_over_udp(pair):
    a, b = pair
    ca, cb, req = connect(a, b)
    # the REQ arrived as sent: QPN, PSN, the cma header and user data in its private data
    assert req.message.local_qpn == 0x111 and req.message.starting_psn == 0xAAA
    hdr, user = split_cma_private_data(req.private_data)
    assert (str(hdr.src), str(hdr.dst), hdr.sport) == (A_IP, B_IP, 40000)
    assert user[:2] == b"hi"
    assert req.message.service_id == SID
    assert ca.state == cb.state == CmState.ESTABLISHED
    assert (ca.remote_id, cb.remote_id) == (cb.local_id, ca.local_id)
    assert cb.dest.src_ip == A_IP and cb.dest.src_qp == 1

    a.disconnect(ca, b"bye")
    ev = next_event(b)
    assert ev.type == E.DREQ_RECEIVED and ev.private_data[:3] == b"bye"
    b.disconnect_reply(cb)
    assert next_event(a).type == E.DREP_RECEIVED
    assert ca.state == cb.state == CmState.TIMEWAIT
    # TIMEWAIT ends by the progress threads' timers (conv(15) = 128 ms), nobody polls
    t0 = time.monotonic()
    assert next_event(a).type == E.TIMEWAIT_EXIT
    assert next_event(b).type == E.TIMEWAIT_EXIT
    assert time.monotonic() - t0 < 2.0
    assert ca.state == cb.state == CmState.IDLE
    assert a.deadline is None and b.deadline is None
    assert a.agent.counters["tx_retries"] == {} and b.agent.counters["tx_retries"] == {}
    for svc in (a, b):
        assert svc.device.counters.gsi_mads_rcvd >= 2


def test_a_lost_req_is_retransmitted_by_the_progress_thread(pair):
    a, b = pair
    dev_a = a.device
    b.listen(SID)
    dev_a.faults.tx.random.loss = 1.0  # the first REQ is lost on a's wire
    t0 = time.monotonic()
    ca = a.connect(B_IP, service_id=SID, local_qpn=0x111, starting_psn=1,
                   private_data=req_private_data(), **FAST)
    dev_a.faults.tx.random.loss = 0.0
    assert dev_a.counters.drops.get(Drop.INJECTED_LOSS.value) == 1
    assert ca.state == CmState.REQ_SENT
    ev = next_event(b)  # only the retransmission can bring it
    assert ev.type == E.REQ_RECEIVED
    assert time.monotonic() - t0 >= 0.2  # after the 258 ms REQ timeout, not at once
    assert a.agent.counters["tx_retries"].get("REQ", 0) >= 1
    b.accept(ev.cm_id, local_qpn=0x222, starting_psn=2)
    assert next_event(a).type == E.REP_RECEIVED
    a.ready_to_use(ca)
    assert next_event(b).type == E.RTU_RECEIVED
    assert ca.state == ev.cm_id.state == CmState.ESTABLISHED


def test_req_retries_run_out_to_req_error(pair):
    a, b = pair
    a.device.faults.tx.random.loss = 1.0
    ca = a.connect(B_IP, service_id=SID, local_qpn=0x111, starting_psn=1, max_cm_retries=2,
                   **FAST)
    ev = next_event(a)
    assert ev.type == E.REQ_ERROR and ev.cm_id is ca and ev.send_status == "timeout"
    assert a.agent.counters["tx_retries"]["REQ"] == 2
    assert a.device.counters.drops[Drop.INJECTED_LOSS.value] == 3
    assert ca.state == CmState.IDLE


def test_a_req_with_no_listener_is_rejected_with_reason_8(pair):
    a, b = pair
    ca = a.connect(B_IP, service_id=SID, local_qpn=0x111, starting_psn=1,
                   private_data=req_private_data(), **FAST)
    ev = next_event(a)
    assert ev.type == E.REJ_RECEIVED and ev.cm_id is ca
    assert ev.reason == RejectReason.INVALID_SERVICE_ID == 8
    assert ca.state == CmState.IDLE and a.deadline is None
    with pytest.raises(queue.Empty):
        b.get_event(timeout=0.05)


def test_a_callback_gets_events_and_may_answer_from_the_progress_thread(pair):
    a, b = pair
    seen = []

    def on_event(ev):  # runs on b's progress thread with b's lock held
        seen.append(ev.type)
        if ev.type == E.REQ_RECEIVED:
            b.accept(ev.cm_id, local_qpn=0x333, starting_psn=3)

    b._user_event = on_event
    b.listen(SID)
    ca = a.connect(B_IP, service_id=SID, local_qpn=0x111, starting_psn=1, **FAST)
    assert next_event(a).type == E.REP_RECEIVED
    a.ready_to_use(ca)
    end = time.monotonic() + 5
    while E.RTU_RECEIVED not in seen and time.monotonic() < end:
        time.sleep(0.005)
    assert seen == [E.REQ_RECEIVED, E.RTU_RECEIVED]


def test_close_unregisters_and_a_second_service_is_refused(pair):
    a, _ = pair
    with pytest.raises(RuntimeError):
        CmService(a.device)
    a.close()
    assert a.device.gsi.handler is None and a not in a.device.timer_qps
    CmService(a.device).close()


def test_a_device_connects_to_itself_through_loopback(pair):
    """A MAD a device sends to itself is delivered after the agent returns (the outbox),
    never inside it: a whole handshake on one device."""
    a, _ = pair
    a.listen(SID)
    ca = a.connect(A_IP, service_id=SID, local_qpn=0x111, starting_psn=1, **FAST)
    ev = next_event(a)
    assert ev.type == E.REQ_RECEIVED and ev.cm_id is not ca
    a.accept(ev.cm_id, local_qpn=0x222, starting_psn=2)
    rep = next_event(a)
    assert rep.type == E.REP_RECEIVED and rep.cm_id is ca
    a.ready_to_use(ca)
    assert next_event(a).type == E.RTU_RECEIVED
    assert ca.state == ev.cm_id.state == CmState.ESTABLISHED
    assert a.agent.counters["tx_retries"] == {}


def test_sidr_resolution_over_udp(pair):
    """udaddy's resolution: SIDR_REQ with a cma header, SIDR_REP with the UD QP and the
    rdma_cm Q_Key; then a SIDR_REQ to a service nobody listens on gets status 1."""
    a, b = pair
    b.listen(USID)
    hdr = CmaHeader(ipaddress.ip_address(A_IP), ipaddress.ip_address(B_IP), 40001)
    pd = cma_private_data(hdr, b"ud-hi", size=SIDR_REQ.private_data_size)
    ca = a.sidr_request(B_IP, service_id=USID, private_data=pd)
    assert ca.state == CmState.SIDR_REQ_SENT
    ev = next_event(b)
    assert ev.type == E.SIDR_REQ_RECEIVED and ev.listen_id.state == CmState.LISTEN
    assert ev.message.request_id == ca.local_id and ev.message.service_id == USID
    assert ev.message.pkey == 0xFFFF
    assert ev.source.src_ip == A_IP and ev.source.src_qp == 1
    # duplicates are told apart by (IP, QPN), not by per-packet fields like the PSN
    assert b.agent.peer_key(ev.source) == (A_IP, 1)
    got_hdr, user = split_cma_private_data(ev.private_data)
    assert (str(got_hdr.src), str(got_hdr.dst), got_hdr.sport) == (A_IP, B_IP, 40001)
    assert user[:5] == b"ud-hi"
    b.sidr_reply(ev.cm_id, qpn=0x333, qkey=RDMA_UDP_QKEY, private_data=b"ud-rep")
    assert ev.cm_id.state == CmState.IDLE
    rep = next_event(a)
    assert rep.type == E.SIDR_REP_RECEIVED and rep.cm_id is ca
    assert rep.status == SidrStatus.SUCCESS
    assert (rep.message.request_id, rep.message.service_id) == (ca.local_id, USID)
    assert (rep.message.qpn, rep.message.qkey) == (0x333, RDMA_UDP_QKEY)
    assert rep.message.tid == ev.message.tid
    assert rep.private_data[:6] == b"ud-rep"
    assert ca.state == CmState.IDLE and a.deadline is None
    assert a.agent.counters["tx_retries"] == {}

    other = a.sidr_request(B_IP, service_id=USID + 1, timeout_ms=256)
    rej = next_event(a)
    assert rej.type == E.SIDR_REP_RECEIVED and rej.cm_id is other
    assert rej.status == SidrStatus.UNSUPPORTED == 1
    with pytest.raises(queue.Empty):
        b.get_event(timeout=0.05)
