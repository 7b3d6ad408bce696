"""rdma_cm (softrdma.rdmacm, docs/cm.md "rdma_cm"): connections by IP address between soft
devices, checked against what Linux's cma.c/cm.c and librdmacm do.

Live devices on 127.0.8.x talk over real UDP (the event style and the synchronous style);
a manual device on a virtual clock gives the paths that take Linux minutes (a REQ nobody
answers: 16 transmissions 6.144 s apart, then UNREACHABLE)."""

from __future__ import annotations

import asyncio
import errno
import select
import time

import pytest

from softrdma.cm.cma import CmaHeader
from softrdma.cm.messages import RejectReason, SidrStatus
from softrdma.errors import PyverbsRDMAError
from softrdma.rdmacm import (
    RAI_PASSIVE, RDMA_PS_TCP, RDMA_PS_UDP, RDMA_UDP_QKEY, AddrInfo, CMEvent, CMEventChannel,
    CMID, ConnParam, UDParam,
)
from softrdma.rdmacm import enums as ce
from softrdma.rdmacm.addr import flow_label
from softrdma.verbs_api import (
    AH, QPCap, QPInitAttr, add_device, remove_device,
)
from softrdma.verbs_api.enums import (
    ibv_access_flags as A, ibv_qp_state as Q, ibv_qp_type, ibv_wc_status,
)

S_IP, C_IP = "127.0.8.1", "127.0.8.2"
E = ce.rdma_cm_event_type


@pytest.fixture
def devices():
    add_device(S_IP, name="rcm-s")
    add_device(C_IP, name="rcm-c")
    try:
        yield
    finally:
        for name in ("rcm-s", "rcm-c"):
            for _ in range(50):  # ids closed: the CM devices close with them
                try:
                    remove_device(name)
                    break
                except PyverbsRDMAError:
                    time.sleep(0.02)


def rc_attr(srq=None) -> QPInitAttr:
    return QPInitAttr(qp_type=ibv_qp_type.IBV_QPT_RC, cap=QPCap(max_send_wr=8, max_recv_wr=8))


def expect(ch: CMEventChannel, want: int, timeout: float = 5.0) -> CMEvent:
    ev = CMEvent(ch, timeout)
    assert ev.event_type == want, (ev.event_str(), ev.status)
    return ev


class Pair:
    """A listener on the server device and a client id resolved to it (event style)."""

    def __init__(self, port: int, ps: int = RDMA_PS_TCP, dport: int | None = None) -> None:
        self.sch, self.cch = CMEventChannel(), CMEventChannel()
        self.listener = CMID(self.sch, port_space=ps)
        self.listener.bind_addr(AddrInfo(src=S_IP, src_service=str(port), flags=RAI_PASSIVE,
                                         port_space=ps))
        self.listener.listen()
        self.client = CMID(self.cch, port_space=ps)
        self.client.resolve_addr(AddrInfo(src=C_IP, dst=S_IP,
                                          dst_service=str(dport or port), port_space=ps))
        expect(self.cch, E.RDMA_CM_EVENT_ADDR_RESOLVED)
        self.client.resolve_route()
        expect(self.cch, E.RDMA_CM_EVENT_ROUTE_RESOLVED)
        self.server: CMID | None = None

    def close(self) -> None:
        for c in (self.client, self.server, self.listener):
            if c is not None:
                c.close()
        self.sch.close()
        self.cch.close()


def test_connect_moves_both_qps_with_linux_attributes(devices):
    p = Pair(7471)
    try:
        p.client.create_qp(rc_attr())
        cqp = p.client.qp
        # librdmacm: the active side's QP is in INIT with no remote access before REP
        assert cqp.state == Q.IBV_QPS_INIT and cqp.attr.qp_access_flags == 0
        p.client.connect(_param(b"hello", resources=2, depth=4, retry=6, rnr_retry=5))
        req = expect(p.sch, E.RDMA_CM_EVENT_CONNECT_REQUEST)
        # 56 bytes of user data after the cma header, resources and depth seen swapped
        assert len(req.private_data) == ce.REQ_PRIVATE_DATA
        assert req.private_data.startswith(b"hello")
        conn = req.param
        assert (conn.responder_resources, conn.initiator_depth) == (4, 2)
        assert (conn.retry_count, conn.rnr_retry_count, conn.qp_num) == (6, 5, cqp.qp_num)
        p.server = CMID(req, listen_id=p.listener)
        p.server.create_qp(rc_attr())
        sqp = p.server.qp
        # the passive side's INIT: remote write, and read/atomic since it answers reads
        assert sqp.attr.qp_access_flags == (A.IBV_ACCESS_REMOTE_WRITE | A.IBV_ACCESS_REMOTE_READ
                                            | A.IBV_ACCESS_REMOTE_ATOMIC)
        p.server.accept(_param(b"welcome", resources=4, depth=2, rnr_retry=3))
        est = expect(p.cch, E.RDMA_CM_EVENT_ESTABLISHED)
        assert len(est.private_data) == ce.REP_PRIVATE_DATA
        assert est.private_data.startswith(b"welcome")
        expect(p.sch, E.RDMA_CM_EVENT_ESTABLISHED)
        ca, sa = cqp.attr, sqp.attr
        assert cqp.state == sqp.state == Q.IBV_QPS_RTS
        # PSNs crossed: what one side sends first is what the other expects first
        assert ca.sq_psn == sa.rq_psn and sa.sq_psn == ca.rq_psn
        assert ca.dest_qp_num == sqp.qp_num and sa.dest_qp_num == cqp.qp_num
        # reads: the client may have 4 outstanding, which the server answers with 4 slots
        # (powers of two: rxe rounds both up)
        assert (ca.max_rd_atomic, sa.max_dest_rd_atomic) == (4, 4)
        assert (sa.max_rd_atomic, ca.max_dest_rd_atomic) == (2, 2)
        # ACK timeout 19 both ways (packet lifetime 18 + 1; the REQ's local ACK timeout)
        assert ca.timeout == 19 and sa.timeout == 19
        assert ca.retry_cnt == 6 and sa.retry_cnt == 6
        # RNR retries: each side's come from the other's message (REQ 5, REP 3)
        assert sa.rnr_retry == 5 and ca.rnr_retry == 3
        # the flow label rdma_cm derives from the ports, in both QPs' paths
        fl = flow_label(p.client.id.src_port, 7471)
        assert ca.ah_attr.gr.flow_label == sa.ah_attr.gr.flow_label == fl
        assert ca.ah_attr.gr.dgid.ip == S_IP and sa.ah_attr.gr.dgid.ip == C_IP
        # and data moves: an RDMA WRITE into the server's memory
        smr = p.server.reg_write(64)
        cmr = p.client.reg_msgs(64)
        cmr.write(b"written by rdma_cm", 18)
        p.client.post_write(cmr, 18, smr.buf, smr.rkey, flags=2)
        wc = p.client.get_send_comp(timeout=5)
        assert wc.status == ibv_wc_status.IBV_WC_SUCCESS
        assert smr.read(18, 0) == b"written by rdma_cm"
    finally:
        p.close()


def _param(data: bytes, **kw) -> ConnParam:
    cp = ConnParam(data_len=len(data), **kw)
    cp.set_private_data(data)
    return cp


def test_disconnect_reaches_both_sides_then_timewait_exit(devices):
    p = Pair(7472)
    try:
        p.client.create_qp(rc_attr())
        p.client.connect(ConnParam())
        req = expect(p.sch, E.RDMA_CM_EVENT_CONNECT_REQUEST)
        p.server = CMID(req, listen_id=p.listener)
        p.server.create_qp(rc_attr())
        p.server.accept()
        expect(p.cch, E.RDMA_CM_EVENT_ESTABLISHED)
        expect(p.sch, E.RDMA_CM_EVENT_ESTABLISHED)
        p.client.disconnect()  # DREQ; our QP to ERROR at once
        assert p.client.qp.state == Q.IBV_QPS_ERR
        ev = expect(p.sch, E.RDMA_CM_EVENT_DISCONNECTED)
        assert ev.status == 0
        p.server.disconnect()  # answers with the DREP
        expect(p.cch, E.RDMA_CM_EVENT_DISCONNECTED)
        # TIMEWAIT lasts conv(ACK timeout 19) = 2048 ms, then TIMEWAIT_EXIT on both
        t0 = time.monotonic()
        expect(p.cch, E.RDMA_CM_EVENT_TIMEWAIT_EXIT, timeout=6)
        expect(p.sch, E.RDMA_CM_EVENT_TIMEWAIT_EXIT, timeout=6)
        assert 1.5 < time.monotonic() - t0 < 5
    finally:
        p.close()


def test_reject_carries_private_data_and_reason_28(devices):
    p = Pair(7473)
    try:
        p.client.create_qp(rc_attr())
        p.client.connect(ConnParam())
        req = expect(p.sch, E.RDMA_CM_EVENT_CONNECT_REQUEST)
        p.server = CMID(req, listen_id=p.listener)
        p.server.reject(b"go away")
        ev = expect(p.cch, E.RDMA_CM_EVENT_REJECTED)
        assert ev.status == RejectReason.CONSUMER_DEFINED == 28
        # the REJECTED event always reports 148 bytes (openucx/ucx#5460)
        assert len(ev.private_data) == ce.REJ_PRIVATE_DATA
        assert ev.private_data.startswith(b"go away")
        assert p.client.qp.state == Q.IBV_QPS_ERR
    finally:
        p.close()


def test_no_listener_is_rejected_with_invalid_service_id(devices):
    p = Pair(7474, dport=7999)  # the server's device is up, nobody listens on 7999
    try:
        p.client.create_qp(rc_attr())
        p.client.connect(ConnParam())
        ev = expect(p.cch, E.RDMA_CM_EVENT_REJECTED)
        assert ev.status == RejectReason.INVALID_SERVICE_ID == 8
    finally:
        p.close()


def test_sync_style_send_and_receive(devices):
    import threading
    lid = CMID(AddrInfo(src=S_IP, src_service="7475", flags=RAI_PASSIVE), rc_attr())
    lid.listen()
    got = {}

    def serve():
        c = lid.get_request(timeout=10)
        mr = c.reg_msgs(32)
        c.post_recv(mr)
        c.accept()
        wc = c.get_recv_comp(timeout=10)
        got["server"] = (wc.status, wc.byte_len, mr.read(wc.byte_len, 0))
        c.post_send(mr, length=wc.byte_len)  # echo
        got["echo"] = c.get_send_comp(timeout=10).status
        got["conn"] = c
    t = threading.Thread(target=serve)
    t.start()
    c = CMID(AddrInfo(src=C_IP, dst=S_IP, dst_service="7475"), rc_attr())
    try:
        mr = c.reg_msgs(32)
        c.post_recv(mr)
        c.connect()
        mr.write(b"ping", 4)
        c.post_send(mr, length=4)
        assert c.get_send_comp(timeout=10).status == ibv_wc_status.IBV_WC_SUCCESS
        wc = c.get_recv_comp(timeout=10)
        t.join(10)
        assert got["server"] == (ibv_wc_status.IBV_WC_SUCCESS, 4, b"ping")
        assert (wc.status, wc.byte_len, mr.read(4, 0)) == (ibv_wc_status.IBV_WC_SUCCESS, 4,
                                                           b"ping")
    finally:
        c.close()
        t.join(10)
        if "conn" in got:
            got["conn"].close()
        lid.close()


def test_sync_connect_to_no_listener_raises_econnrefused(devices):
    lid = CMID(AddrInfo(src=S_IP, src_service="7476", flags=RAI_PASSIVE))
    lid.listen()  # the server's device is up; port 7477 has no listener
    c = CMID(AddrInfo(src=C_IP, dst=S_IP, dst_service="7477"), rc_attr())
    try:
        with pytest.raises(PyverbsRDMAError) as ei:
            c.connect()
        assert ei.value.error_code == errno.ECONNREFUSED
    finally:
        c.close()
        lid.close()


def test_ud_service_resolution_and_datagrams(devices):
    """udaddy's path: SIDR_REQ/SIDR_REP, then UD sends with rdma_cm's Q_Key."""
    p = Pair(7174, ps=RDMA_PS_UDP)
    try:
        ud = QPInitAttr(qp_type=ibv_qp_type.IBV_QPT_UD, cap=QPCap(max_send_wr=4,
                                                                 max_recv_wr=4))
        p.client.create_qp(ud)
        assert p.client.qp.state == Q.IBV_QPS_RTS  # UD: straight to RTS
        assert p.client.qp.attr.qkey == RDMA_UDP_QKEY
        p.client.connect(_param(b"sidr!"))
        req = expect(p.sch, E.RDMA_CM_EVENT_CONNECT_REQUEST)
        assert len(req.private_data) == ce.SIDR_REQ_PRIVATE_DATA
        assert req.private_data.startswith(b"sidr!")
        p.server = CMID(req, listen_id=p.listener)
        p.server.create_qp(ud)
        smr = p.server.reg_msgs(128)
        p.server.post_recv(smr)
        p.server.accept()
        est = expect(p.cch, E.RDMA_CM_EVENT_ESTABLISHED)
        par = UDParam(est)
        assert (par.qp_num, par.qkey) == (p.server.qpn, RDMA_UDP_QKEY)
        ah = AH(p.client.pd, par.ah_attr)
        cmr = p.client.reg_msgs(16)
        cmr.write(b"datagram", 8)
        p.client.post_ud_send(cmr, ah, par.qp_num, length=8)
        assert p.client.get_send_comp(timeout=5).status == ibv_wc_status.IBV_WC_SUCCESS
        wc = p.server.get_recv_comp(timeout=5)
        assert wc.status == ibv_wc_status.IBV_WC_SUCCESS and wc.byte_len == 40 + 8
        assert smr.read(8, 40) == b"datagram"  # after the 40-byte GRH
    finally:
        p.close()


def test_ud_resolution_without_listener_is_unreachable_status_1(devices):
    p = Pair(7177, ps=RDMA_PS_UDP, dport=7999)
    try:
        p.client.create_qp(QPInitAttr(qp_type=ibv_qp_type.IBV_QPT_UD))
        p.client.connect()
        ev = expect(p.cch, E.RDMA_CM_EVENT_UNREACHABLE)
        assert ev.status == SidrStatus.UNSUPPORTED == 1
    finally:
        p.close()


def test_unanswered_req_is_unreachable_after_linux_retries():
    """A manual device on a virtual clock: the REQ goes nowhere, is sent 16 times 6.144 s
    apart (2*conv(18) + conv(20)) and the id gets UNREACHABLE with -ETIMEDOUT."""
    dev = add_device("127.0.8.20", name="rcm-v", live=False)
    try:
        ch = CMEventChannel()
        cid = CMID(ch)
        cid.resolve_addr(AddrInfo(src="127.0.8.20", dst="127.0.8.21", dst_service="7471"))
        expect(ch, E.RDMA_CM_EVENT_ADDR_RESOLVED)
        cid.resolve_route()
        expect(ch, E.RDMA_CM_EVENT_ROUTE_RESOLVED)
        cid.create_qp(rc_attr())
        t0 = dev.now
        cid.connect(ConnParam())
        ev = expect(ch, E.RDMA_CM_EVENT_UNREACHABLE)
        assert ev.status == -errno.ETIMEDOUT
        assert dev.now - t0 == pytest.approx(16 * 6.144)
        agent = cid.id.cdev.service.agent
        assert agent.counters["tx"]["REQ"] == 16
        assert agent.counters["tx_retries"]["REQ"] == 15
        cid.close()
        ch.close()
    finally:
        remove_device("rcm-v")


def test_the_req_carries_the_cma_header_and_linux_path(devices):
    """What goes on the wire: the REQ's cma header names both ends, and the path fields
    are those cma_resolve_iboe_route builds (the capture test checks them against rxe)."""
    p = Pair(7478)
    try:
        p.client.create_qp(rc_attr())
        p.client.connect(ConnParam())
        expect(p.sch, E.RDMA_CM_EVENT_CONNECT_REQUEST)
        req = p.client.id.cm.req
        hdr = CmaHeader.unpack(req.private_data)
        assert (str(hdr.src), str(hdr.dst), hdr.sport) == (C_IP, S_IP, p.client.id.src_port)
        assert req.service_id == (RDMA_PS_TCP << 16) | 7478
        assert (req.primary_hop_limit, req.primary_local_ack_timeout) == (64, 19)
        assert (req.remote_cm_response_timeout, req.local_cm_response_timeout,
                req.max_cm_retries) == (20, 20, 15)
        assert req.primary_flow_label == flow_label(p.client.id.src_port, 7478)
        assert req.starting_psn == p.client.id.seq_num
    finally:
        p.close()


def test_event_channel_fd_works_with_select_and_asyncio(devices):
    p = Pair(7479)
    try:
        p.client.create_qp(rc_attr())
        r, _, _ = select.select([p.sch.fd], [], [], 0)
        assert not r  # nothing pending yet
        p.client.connect(ConnParam())
        r, _, _ = select.select([p.sch.fd], [], [], 5)
        assert r == [p.sch.fd]
        req = CMEvent(p.sch, 0)
        p.server = CMID(req, listen_id=p.listener)
        p.server.create_qp(rc_attr())
        p.server.accept()

        async def wait_established():
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            loop.add_reader(p.cch.fd, lambda: fut.done() or fut.set_result(None))
            try:
                await asyncio.wait_for(fut, 5)
            finally:
                loop.remove_reader(p.cch.fd)
            return CMEvent(p.cch, 0)
        ev = asyncio.run(wait_established())
        assert ev.event_type == E.RDMA_CM_EVENT_ESTABLISHED
    finally:
        p.close()


def test_bad_calls_get_errno_naming_the_problem(devices):
    ch = CMEventChannel()
    try:
        with pytest.raises(PyverbsRDMAError) as ei:
            CMID(ch, port_space=0x1234)
        assert ei.value.error_code == errno.EINVAL and "port space" in str(ei.value)
        a = CMID(ch)
        a.bind_addr(AddrInfo(src=S_IP, src_service="7480", flags=RAI_PASSIVE))
        b = CMID(ch)
        with pytest.raises(PyverbsRDMAError) as ei:
            b.bind_addr(AddrInfo(src=S_IP, src_service="7480", flags=RAI_PASSIVE))
        assert ei.value.error_code == errno.EADDRINUSE
        with pytest.raises(PyverbsRDMAError) as ei:
            b.bind_addr(AddrInfo(src="192.0.2.77", flags=RAI_PASSIVE))  # TEST-NET-1
        assert ei.value.error_code == errno.ENODEV
        with pytest.raises(PyverbsRDMAError) as ei:
            b.connect()  # not resolved
        assert ei.value.error_code == errno.EINVAL and "IDLE" in str(ei.value)
        c = CMID(ch)
        c.resolve_addr(AddrInfo(src=C_IP, dst=S_IP, dst_service="7480"))
        expect(ch, E.RDMA_CM_EVENT_ADDR_RESOLVED)
        c.resolve_route()
        expect(ch, E.RDMA_CM_EVENT_ROUTE_RESOLVED)
        c.create_qp(rc_attr())
        with pytest.raises(PyverbsRDMAError) as ei:
            c.connect(_param(bytes(57)))
        assert ei.value.error_code == errno.EINVAL and "56" in str(ei.value)
        with pytest.raises(PyverbsRDMAError) as ei:
            c.connect(ConnParam(resources=200))
        assert ei.value.error_code == errno.EINVAL and "responder_resources" in str(ei.value)
        for x in (a, b, c):
            x.close()
    finally:
        ch.close()


def test_wildcard_listener_takes_requests_on_its_port(devices):
    sch, cch = CMEventChannel(), CMEventChannel()
    lid = CMID(sch)
    lid.bind_addr(AddrInfo(src="0.0.0.0", src_service="7481", flags=RAI_PASSIVE))
    lid.listen()
    c = CMID(cch)
    try:
        c.resolve_addr(AddrInfo(src=C_IP, dst=S_IP, dst_service="7481"))
        expect(cch, E.RDMA_CM_EVENT_ADDR_RESOLVED)
        c.resolve_route()
        expect(cch, E.RDMA_CM_EVENT_ROUTE_RESOLVED)
        c.create_qp(rc_attr())
        c.connect(ConnParam())
        req = expect(sch, E.RDMA_CM_EVENT_CONNECT_REQUEST)
        s = CMID(req, listen_id=lid)
        assert s.dev_name == "rcm-s"
        s.create_qp(rc_attr())
        s.accept()
        expect(cch, E.RDMA_CM_EVENT_ESTABLISHED)
        s.close()
    finally:
        c.close()
        lid.close()
        sch.close()
        cch.close()


def test_ipv6_connection(devices):
    """rdma_cm over IPv6: GIDs are the addresses themselves, the cma header says 6."""
    import threading
    add_device("::1", name="rcm-v6")
    try:
        lid = CMID(AddrInfo(src="::1", src_service="7482", flags=RAI_PASSIVE), rc_attr())
        lid.listen()
        got = {}

        def serve():
            c = lid.get_request(timeout=10)
            mr = c.reg_msgs(16)
            c.post_recv(mr)
            c.accept()
            wc = c.get_recv_comp(timeout=10)
            got["data"] = mr.read(wc.byte_len, 0)
            c.close()
        t = threading.Thread(target=serve)
        t.start()
        c = CMID(AddrInfo(dst="::1", dst_service="7482"), rc_attr())
        c.connect()
        hdr = CmaHeader.unpack(c.id.cm.req.private_data)
        assert hdr.ip_version == 6 and str(hdr.dst) == "::1"
        assert bytes(c.id.cm.req.primary_remote_gid) == bytes(15) + b"\x01"
        mr = c.reg_msgs(16)
        mr.write(b"over v6", 7)
        c.post_send(mr, length=7)
        assert c.get_send_comp(timeout=5).status == ibv_wc_status.IBV_WC_SUCCESS
        t.join(10)
        assert got["data"] == b"over v6"
        c.close()
        lid.close()
    finally:
        for _ in range(50):
            try:
                remove_device("rcm-v6")
                break
            except PyverbsRDMAError:
                time.sleep(0.02)


def test_lost_rtu_is_recovered_by_the_rep_retransmission(devices):
    """The client's RTU is lost: the server's CM resends its REP after conv(20) = 4096 ms,
    the client's CM answers the duplicate REP with the RTU again (cm.c
    cm_dup_rep_handler), and only then is the server ESTABLISHED."""
    from softrdma.cm.messages import parse_cm as _parse_cm
    from softrdma.wire.packet import parse as _parse
    p = Pair(7483)
    try:
        p.client.create_qp(rc_attr())
        dev = p.client.id.device
        real = dev.transmit
        dropped = []

        def lossy(data, dst, sport):
            pkt = _parse(bytes(data))
            if pkt.dest_qp == 1 and _parse_cm(pkt.payload).name == "RTU" and not dropped:
                dropped.append(time.monotonic())
                return
            real(data, dst, sport)
        dev.transmit = lossy
        p.client.connect(ConnParam())
        req = expect(p.sch, E.RDMA_CM_EVENT_CONNECT_REQUEST)
        p.server = CMID(req, listen_id=p.listener)
        p.server.create_qp(rc_attr())
        p.server.accept()
        expect(p.cch, E.RDMA_CM_EVENT_ESTABLISHED)
        assert dropped  # the first RTU went nowhere
        expect(p.sch, E.RDMA_CM_EVENT_ESTABLISHED, timeout=8)
        waited = time.monotonic() - dropped[0]
        assert 3.5 < waited < 6.0, waited  # the REP's 4.096 s timer, not sooner
        agent = p.client.id.cdev.service.agent
        assert agent.counters["rx_duplicates"]["REP"] == 1
        assert agent.counters["tx"]["RTU"] == 2
        dev.transmit = real
    finally:
        p.close()


def test_a_reject_from_the_same_device_reaches_the_connecting_id(devices):
    """Loopback on one device: the REJ comes back while connect() is still running (the
    device answers its own REQ at once); the REJECTED event must not be lost."""
    lid = CMID(AddrInfo(src=S_IP, src_service="7484", flags=RAI_PASSIVE))
    lid.listen()
    ch = CMEventChannel()
    c = CMID(ch)
    try:
        c.resolve_addr(AddrInfo(dst=S_IP, dst_service="7485"))
        expect(ch, E.RDMA_CM_EVENT_ADDR_RESOLVED)
        c.resolve_route()
        expect(ch, E.RDMA_CM_EVENT_ROUTE_RESOLVED)
        assert c.dev_name == "rcm-s"  # the listener's own device
        c.create_qp(rc_attr())
        c.connect(ConnParam())
        assert expect(ch, E.RDMA_CM_EVENT_REJECTED).status == 8
    finally:
        c.close()
        lid.close()
        ch.close()


# ---- the accessors other layers use (CMID / CMEventChannel) ------------------------------

def _connected(p: Pair) -> None:
    p.client.create_qp(rc_attr())
    p.client.connect(ConnParam())
    req = expect(p.sch, E.RDMA_CM_EVENT_CONNECT_REQUEST)
    p.server = CMID(req, listen_id=p.listener)
    p.server.create_qp(rc_attr())
    p.server.accept()
    expect(p.cch, E.RDMA_CM_EVENT_ESTABLISHED)
    expect(p.sch, E.RDMA_CM_EVENT_ESTABLISHED)


def test_local_and_peer_addr_are_what_getsockname_and_getpeername_give(devices):
    p = Pair(7490)
    try:
        cport = p.client.local_addr[1]
        assert 32768 <= cport <= 60999  # an ephemeral port (ip_local_port_range)
        assert p.client.local_addr == (C_IP, cport)
        assert p.client.peer_addr == (S_IP, 7490)
        assert p.listener.local_addr == (S_IP, 7490)
        with pytest.raises(PyverbsRDMAError) as ei:  # a listener has no peer
            p.listener.peer_addr
        assert ei.value.error_code == errno.ENOTCONN
        _connected(p)
        assert p.server.local_addr == (S_IP, 7490)
        assert p.server.peer_addr == (C_IP, cport)
        # the REQ's cma header named them: the server learnt them from the wire
        hdr = CmaHeader.unpack(p.client.id.cm.req.private_data)
        assert (str(hdr.src), hdr.sport) == p.server.peer_addr
    finally:
        p.close()


def test_path_ack_timeout_is_the_reqs_on_the_passive_side_and_the_routes_on_the_active(
        devices):
    """cm.c: the active side's QP gets packet_life_time + 1 from its path, the passive
    side the REQ's primary_local_ack_timeout, cm_ack_timeout(ACK delay 15, lifetime).
    With a lifetime of 14 instead of RoCE's 18 the two differ: 15 and 16."""
    p = Pair(7491)
    try:
        fresh = CMID(p.cch)
        assert fresh.path_ack_timeout == 0  # nothing known yet
        fresh.close()
        assert p.client.path_ack_timeout == 18 + 1
        p.client.id.route.packet_life_time = 14  # what an SA path could say instead
        assert p.client.path_ack_timeout == 15
        _connected(p)
        assert p.server.path_ack_timeout == 16  # cm_ack_timeout(15, 14)
        assert int(p.server.id.req.primary_local_ack_timeout) == 16
        assert p.client.path_ack_timeout == 15
    finally:
        p.close()


def test_migrate_sends_the_ids_later_events_to_the_new_channel(devices):
    p = Pair(7492)
    own = CMEventChannel()
    try:
        _connected(p)
        p.server.migrate(own)  # rdma_migrate_id
        p.client.disconnect()
        expect(own, E.RDMA_CM_EVENT_DISCONNECTED)
        assert not p.sch.pending()  # nothing for the migrated id on the listener's
        with pytest.raises(PyverbsRDMAError) as ei:
            p.server.migrate(p.sch.channel)  # not a CMEventChannel
        assert ei.value.error_code == errno.EINVAL
    finally:
        p.close()
        own.close()


def test_channel_wait_blocks_until_an_event_or_the_timeout(devices):
    p = Pair(7493)
    try:
        t0 = time.monotonic()
        p.cch.wait(0.2)  # nothing comes
        assert 0.15 < time.monotonic() - t0 < 2
        assert p.cch.pending() is False
        t0 = time.monotonic()
        p.cch.wait(-5)  # a negative timeout is 0
        assert time.monotonic() - t0 < 0.1
        p.client.create_qp(rc_attr())
        p.client.connect(ConnParam())
        t0 = time.monotonic()
        p.sch.wait(5)  # the CONNECT_REQUEST wakes it
        assert time.monotonic() - t0 < 2 and p.sch.pending() is True
        p.sch.wait(None)  # an event waits: returns at once
        expect(p.sch, E.RDMA_CM_EVENT_CONNECT_REQUEST)  # wait took none
    finally:
        p.close()


def test_sync_style_completion_wait_ends_at_its_timeout(devices):
    """``get_recv_comp(timeout)`` with nothing coming returns None at the timeout (issue
    26, found by ``softrdma fuzz --target records``): it used to wait for a CQ event
    with no limit once its first look found none, so a 0.3 s wait was still blocked 5 s
    later."""
    import threading
    lid = CMID(AddrInfo(src=S_IP, src_service="7479", flags=RAI_PASSIVE), rc_attr())
    lid.listen()
    box = {}

    def serve() -> None:
        box["c"] = lid.get_request(timeout=10)
        box["c"].accept()
    t = threading.Thread(target=serve)
    t.start()
    c = CMID(AddrInfo(src=C_IP, dst=S_IP, dst_service="7479"), rc_attr())
    try:
        mr = c.reg_msgs(32)
        c.post_recv(mr)
        c.connect()
        t.join(10)
        done = {}

        def wait() -> None:
            t0 = time.monotonic()
            done["wc"] = c.get_recv_comp(timeout=0.3)
            done["took"] = time.monotonic() - t0
        w = threading.Thread(target=wait, daemon=True)
        w.start()
        w.join(5)
        assert not w.is_alive(), "get_recv_comp(timeout=0.3) still blocked after 5 s"
        assert done["wc"] is None and done["took"] < 3, done
    finally:
        c.close()
        t.join(10)
        if "c" in box:
            box["c"].close()
        lid.close()


def test_migrate_takes_the_ids_waiting_events_along(devices):
    """rdma_migrate_id moves the events already queued for the id (ucma_migrate_id moves
    them to the new file): an ESTABLISHED waiting on the listener's channel when the
    server id migrates is read on the new channel, not left behind on the old one (the
    socket layer used to route such strays by hand)."""
    p = Pair(7497)
    own = CMEventChannel()
    try:
        p.client.create_qp(rc_attr())
        p.client.connect(ConnParam())
        req = expect(p.sch, E.RDMA_CM_EVENT_CONNECT_REQUEST)
        p.server = CMID(req, listen_id=p.listener)
        p.server.create_qp(rc_attr())
        p.server.accept(ConnParam())
        expect(p.cch, E.RDMA_CM_EVENT_ESTABLISHED)
        deadline = time.monotonic() + 5
        while not p.sch.pending() and time.monotonic() < deadline:
            p.sch.wait(0.05)  # the server's ESTABLISHED arrives on the listener's channel
        assert p.sch.pending()
        p.server.migrate(own)
        assert not p.sch.pending()
        ev = expect(own, E.RDMA_CM_EVENT_ESTABLISHED, timeout=0)
        assert ev.id is p.server.id
    finally:
        p.close()
        own.close()
