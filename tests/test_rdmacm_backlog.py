"""``rdma_listen(backlog)`` is enforced as Linux enforces it (issue 26 point 3).

Linux (drivers/infiniband/core/ucma.c, cma.c, cm.c): ucma keeps a counter per listener,
set by rdma_listen (a backlog <= 0 or above ``net.rdma_ucm.max_backlog``, 1024, gives
1024); queuing a CONNECT_REQUEST takes one, ``rdma_get_cm_event`` taking it gives it back.
With none left the event handler returns -ENOMEM, cma drops the new id and the IB CM,
in REQ_RCVD, forgets the REQ *without* a REJ ("Do not reject to allow future retries"):
the client's CM retransmits the REQ and it is a new request then, like a TCP SYN dropped
on a full accept queue. The MRA goes only after the request was queued. A SIDR_REQ (UD
listener) in the same case is answered SIDR_REP REJECT (cm_destroy_id in SIDR_REQ_RCVD).

Forged requests go into a manual device as QP1 receives them (tests/cm_forge.py); the
real-client case uses one manual device connecting to itself, on its virtual clock.
"""

from __future__ import annotations

import errno
import gc
import tracemalloc

import pytest

from softrdma.cm.messages import RTU, SidrStatus, build_cm
from softrdma.errors import PyverbsRDMAError
from softrdma.rdmacm import (
    RAI_PASSIVE, RDMA_PS_UDP, AddrInfo, CMEvent, CMEventChannel, CMID, ConnParam,
)
from softrdma.rdmacm import enums as ce
from softrdma.rdmacm.cm_id import RDMA_UCM_MAX_BACKLOG
from softrdma.verbs_api import QPCap, QPInitAttr, add_device, remove_device
from softrdma.verbs_api.enums import ibv_qp_type

from .cm_forge import (
    PORT, SERVER, Wire, cma_header, deliver, forged_req, forged_sidr_req, listening,
)

E = ce.rdma_cm_event_type
#: rdma_cm's REQ retransmission interval on RoCE: 2*conv(packet lifetime 18) +
#: conv(CMA_CM_RESPONSE_TIMEOUT 20) = 2*1024 + 4096 ms (cm.c, cma.c)
REQ_RTX = (2 * 2 ** (18 - 8) + 2 ** (20 - 8)) / 1000


def rc_attr() -> QPInitAttr:
    return QPInitAttr(qp_type=ibv_qp_type.IBV_QPT_RC, cap=QPCap(max_send_wr=4, max_recv_wr=4))


@pytest.fixture
def server():
    """A manual device holding the address the forged requests go to."""
    dev = add_device(SERVER, name="backlog", live=False, mtu=1500)
    try:
        yield dev
    finally:
        remove_device("backlog")


def test_a_full_backlog_forgets_requests_without_an_answer_and_a_retry_connects(server):
    """A listen(8) listener that takes nothing, flooded with 2,000 forged REQs, queues
    exactly 8 CONNECT_REQUESTs; the other 1,992 are forgotten: no REJ, no MRA, no id,
    counted in the CM's ``listen_overflow``, and memory stays flat (before: every REQ
    queued an event and two ids, about 5.8 KB each, 11 MiB for the flood). Once the
    application takes the events, a retransmission of a forgotten REQ is a new request
    that connects."""
    ch = CMEventChannel()
    try:
        lid = listening(ch, 8)
        wire = Wire(server)
        flood = [forged_req(n) for n in range(2000)]
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for mad in flood:
                deliver(server, mad)
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert ch.channel.pending() == 8
        assert wire.mads() == []  # no REJ, and no MRA either (it follows the queuing)
        service = lid.id.cdev.service
        assert service.counters["listen_overflow"] == {"REQ": 1992}
        assert grown < 1 << 20, f"{grown} bytes for 1,992 dropped requests"
        # a duplicate of a dropped REQ, still no room: dropped again, still no answer
        deliver(server, flood[100])
        assert ch.channel.pending() == 8 and wire.mads() == []
        assert service.counters["listen_overflow"]["REQ"] == 1993

        taken = [CMEvent(ch, 0) for _ in range(8)]
        assert {ev.event_type for ev in taken} == {E.RDMA_CM_EVENT_CONNECT_REQUEST}
        deliver(server, flood[100])  # the client's CM retransmits: room now
        ev = CMEvent(ch, 0)
        assert ev.event_type == E.RDMA_CM_EVENT_CONNECT_REQUEST
        child = CMID(ev, listen_id=lid)
        child.create_qp(rc_attr())
        child.accept(ConnParam())
        (rep,) = wire.mads("REP")
        assert rep.remote_comm_id == 0x10000 + 100
        deliver(server, build_cm(RTU, tid=rep.tid, local_comm_id=0x10000 + 100,
                                 remote_comm_id=rep.local_comm_id))
        assert CMEvent(ch, 0).event_type == E.RDMA_CM_EVENT_ESTABLISHED
        assert wire.mads("REJ") == []
        child.close()
        for ev in taken:
            CMID(ev, listen_id=lid).close()
        lid.close()
    finally:
        ch.close()


def test_a_real_clients_dropped_req_is_retransmitted_and_then_accepted():
    """Two rdma_cm clients against listen(1) on one manual device (it connects to
    itself): the second REQ finds the backlog full and is forgotten with no REJ (the
    client sees no event); when the application has taken the first request, the
    client's own REQ retransmission (6.144 s of virtual time later) is queued, and the
    connection is established."""
    ip = "127.0.9.40"
    dev = add_device(ip, name="backlog-rc", live=False)
    sch, c1ch, c2ch = CMEventChannel(), CMEventChannel(), CMEventChannel()
    try:
        wire = Wire(dev, forward=True)
        lid = CMID(sch)
        lid.bind_addr(AddrInfo(src=ip, src_service="7600", flags=RAI_PASSIVE))
        lid.listen(1)
        clients = []
        for ch in (c1ch, c2ch):
            c = CMID(ch)
            c.resolve_addr(AddrInfo(src=ip, dst=ip, dst_service="7600"))
            assert CMEvent(ch, 5).event_type == E.RDMA_CM_EVENT_ADDR_RESOLVED
            c.resolve_route()
            assert CMEvent(ch, 5).event_type == E.RDMA_CM_EVENT_ROUTE_RESOLVED
            c.create_qp(rc_attr())
            c.connect(ConnParam())
            while dev.step(jump_to_timer=False):  # the REQ reaches the listener
                pass
            clients.append(c)
        t0 = dev.now
        assert sch.channel.pending() == 1  # the first; the second was forgotten
        assert not c2ch.pending() and wire.mads("REJ") == []
        assert lid.id.cdev.service.counters["listen_overflow"] == {"REQ": 1}
        first = CMEvent(sch, 0)
        assert first.event_type == E.RDMA_CM_EVENT_CONNECT_REQUEST
        # waiting moves the virtual clock to the second client's REQ retransmission
        ev = CMEvent(sch, 30)
        assert ev.event_type == E.RDMA_CM_EVENT_CONNECT_REQUEST
        assert dev.now - t0 == pytest.approx(REQ_RTX)
        child = CMID(ev, listen_id=lid)
        assert child.id.dst_port == clients[1].id.src_port
        child.create_qp(rc_attr())
        child.accept(ConnParam())
        assert CMEvent(c2ch, 30).event_type == E.RDMA_CM_EVENT_ESTABLISHED
        assert CMEvent(sch, 30).event_type == E.RDMA_CM_EVENT_ESTABLISHED
        assert wire.mads("REJ") == []
        child.close()
        CMID(first, listen_id=lid).close()
        for c in clients:
            c.close()
        lid.close()
    finally:
        for ch in (sch, c1ch, c2ch):
            ch.close()
        remove_device("backlog-rc")


@pytest.mark.parametrize("backlog", [0, -3, RDMA_UCM_MAX_BACKLOG + 1])
def test_backlog_out_of_range_is_net_rdma_ucm_max_backlog(server, backlog):
    """listen(0), a negative backlog and one above the maximum all get 1024
    (``ucma_listen``: ``backlog <= 0 || backlog > max_backlog``): 1,100 requests queue
    1,024 events."""
    ch = CMEventChannel()
    try:
        lid = listening(ch, backlog)
        assert lid.id.backlog == RDMA_UCM_MAX_BACKLOG == 1024
        for n in range(1100):
            deliver(server, forged_req(n))
        assert ch.channel.pending() == 1024
        assert lid.id.cdev.service.counters["listen_overflow"] == {"REQ": 76}
        lid.close()
    finally:
        ch.close()


def test_a_full_ud_listener_refuses_sidr_requests_with_reject(server):
    """A UD listener (RDMA_PS_UDP) with listen(1): the first SIDR_REQ is queued, the
    second answered SIDR_REP REJECT (status 2), as cm_destroy_id does for an id in
    SIDR_REQ_RCVD whose consumer returned -ENOMEM; no id stays for it."""
    ch = CMEventChannel()
    try:
        lid = listening(ch, 1, ps=RDMA_PS_UDP)
        wire = Wire(server)
        deliver(server, forged_sidr_req(0, PORT))
        deliver(server, forged_sidr_req(1, PORT))
        assert ch.channel.pending() == 1
        (rep,) = wire.mads("SIDR_REP")
        assert rep.status == SidrStatus.REJECT == 2 and rep.request_id == 0x20000 + 1
        service = lid.id.cdev.service
        assert service.counters["listen_overflow"] == {"SIDR_REQ": 1}
        ev = CMEvent(ch, 0)
        assert ev.event_type == E.RDMA_CM_EVENT_CONNECT_REQUEST
        deliver(server, forged_sidr_req(1, PORT))  # room again: queued
        assert ch.channel.pending() == 1
        CMID(ev, listen_id=lid).close()
        CMID(CMEvent(ch, 0), listen_id=lid).close()
        lid.close()
    finally:
        ch.close()


def test_refused_requests_leave_no_cm_id(server):
    """A request rdma_cm refuses (a cma header naming another address: REJ 28; a port
    nobody listens on: REJ 8) is answered and its CM id goes, as cm_destroy_id does:
    before, each refused REQ left an IDLE id in the CM for ever."""
    ch = CMEventChannel()
    try:
        lid = listening(ch, 8)
        wire = Wire(server)
        for n in range(50):
            deliver(server, forged_req(n, service_id=(0x0106 << 16) | (PORT + 1)))
        assert {m.reason for m in wire.mads("REJ")} == {8}
        for n in range(50, 100):  # a cma header naming an address not the listener's
            deliver(server, forged_req(n, private_data=cma_header(dst="10.77.0.99")))
        assert len(wire.mads("REJ")) == 100
        assert {m.reason for m in wire.mads("REJ")[50:]} == {28}
        assert ch.channel.pending() == 0
        assert lid.id.cdev.service.id_count == 1  # the listener's
        lid.close()
    finally:
        ch.close()


def test_listen_backlog_must_be_an_int(server):
    """A backlog that is no int is EINVAL naming it."""
    ch = CMEventChannel()
    try:
        lid = CMID(ch)
        lid.bind_addr(AddrInfo(src=SERVER, src_service=str(PORT), flags=RAI_PASSIVE))
        with pytest.raises(Exception, match="backlog must be an int"):
            lid.listen("8")
        lid.close()
    finally:
        ch.close()


def test_requests_nobody_took_go_with_their_listener(server):
    """Destroying a listener destroys the connection requests still queued for it, as
    ucma does (``ucma_cleanup_ctx_events``): each is rejected (REJ 28, what
    rdma_destroy_id sends for a request not answered), its CM id goes, and the
    application never reads the stale CONNECT_REQUESTs. Before, they stayed, each with
    its ids, until the channel was closed."""
    ch = CMEventChannel()
    try:
        lid = listening(ch, 8)
        bystander = CMID(ch)  # keeps the device's CM open after the listener goes
        bystander.bind_addr(AddrInfo(src=SERVER, src_service=str(PORT + 1), flags=RAI_PASSIVE))
        service = lid.id.cdev.service
        wire = Wire(server)
        for n in range(3):
            deliver(server, forged_req(n))
        assert ch.channel.pending() == 3
        lid.close()
        rejs = wire.mads("REJ")
        assert sorted(m.remote_comm_id for m in rejs) == [0x10000 + n for n in range(3)]
        assert {m.reason for m in rejs} == {28}
        with pytest.raises(PyverbsRDMAError) as e:
            CMEvent(ch, 0)
        assert e.value.error_code == errno.ETIMEDOUT
        assert service.id_count == 0 and not service.closed
        bystander.close()
    finally:
        ch.close()


def test_reject_after_the_peer_rejected_is_einval(server):
    """``rdma_reject`` on a request the peer already rejected (its REJ came in right
    after its REQ) fails as ib_send_cm_rej does, with EINVAL in a PyverbsRDMAError; it
    used to raise the CM's internal CmStateError (found by ``softrdma fuzz --target
    cm``)."""
    from softrdma.cm.messages import REJ, MsgResponse, RejectReason
    ch = CMEventChannel()
    try:
        lid = listening(ch, 8)
        deliver(server, forged_req(1))
        ev = CMEvent(ch, 0)
        assert ev.event_type == E.RDMA_CM_EVENT_CONNECT_REQUEST
        child = CMID(ev, listen_id=lid)
        ours = child.id.cm.local_id  # (a forger learns it from the MRA or REP)
        deliver(server, build_cm(REJ, tid=0x999, local_comm_id=0x10001, remote_comm_id=ours,
                                 message_rejected=MsgResponse.OTHER,
                                 reason=RejectReason.CONSUMER_DEFINED))
        with pytest.raises(PyverbsRDMAError) as e:
            child.reject(b"no")
        assert e.value.error_code == errno.EINVAL
        assert "no longer pending" in str(e.value)
    finally:
        ch.close()
