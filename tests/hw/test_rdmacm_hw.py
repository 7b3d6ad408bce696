"""softrdma.rdmacm on a real device through librdmacm (softrdma.ibverbs.cma), and the
socket layer, the message queue and the rsocket protocol on top of it, unchanged.

Collected only where there is a device (tests/hw/conftest.py); CI runs it inside a lab
guest on rxe0 (tests/interop/test_socket_hw.py, and with the rest of tests/hw in
tests/interop/test_backend_conformance.py). By hand, in a guest::

    SOFTRDMA_IBV_DEVICE=rxe0 .venv/bin/python -m pytest -q -p no:cacheprovider \\
        tests/hw/test_rdmacm_hw.py

Both ends run in this process on the device's own IPv4 address (rxe loops it back), the
event style driven by hand, the synchronous style and the sockets on threads.
"""

from __future__ import annotations

import errno
import glob
import itertools
import os
import random
import subprocess
import threading
import time

import pytest

from softrdma import socket as rsock
from softrdma.errors import PyverbsRDMAError
from softrdma.ibverbs import cma, cma_select
from softrdma.rdmacm import (
    RAI_PASSIVE, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, RDMA_PS_UDP, RDMA_UDP_QKEY,
    AddrInfo, CMEventChannel, CMID, ConnParam, UDParam,
)
from softrdma.rdmacm import cmid as soft_cmid
from softrdma.rdmacm.enums import rdma_cm_event_type as EV
from softrdma.socket import Receiver
from softrdma.socket.rsocket import RSocket
from softrdma.verbs_api import AH, QPCap, QPInitAttr, set_backend
from softrdma.verbs_api import enums as E


def _device() -> str:
    want = os.environ.get("SOFTRDMA_IBV_DEVICE")
    if want:
        return want
    from softrdma.ibverbs import devices
    return devices.list_devices()[0].name


DEV = _device()
PORTS = itertools.count(random.randint(20000, 40000))
RC = QPInitAttr(qp_type=E.IBV_QPT_RC, cap=QPCap(max_send_wr=8, max_recv_wr=8))


def _ipv4(dev: str) -> str | None:
    """The device's IPv4 address, from its IPv4-mapped GID (rxe: index 1)."""
    for path in sorted(glob.glob(f"/sys/class/infiniband/{dev}/ports/1/gids/*")):
        try:
            raw = bytes.fromhex(open(path).read().strip().replace(":", ""))
        except (OSError, ValueError):
            continue
        if raw[:12] == bytes(10) + b"\xff\xff" and raw[12:] != bytes(4):
            return ".".join(str(b) for b in raw[12:])
    return None  # (collected on a host without the device: the fixture below says so)


IP = _ipv4(DEV)


@pytest.fixture(scope="module", autouse=True)
def rdma_cm_device():
    """librdmacm needs /dev/infiniband/rdma_cm (the rdma_ucm module; udev loads it on a
    distribution, a lab guest has no udev)."""
    if not os.path.exists("/dev/infiniband/rdma_cm") and os.geteuid() == 0:
        subprocess.run(["modprobe", "rdma_ucm"], capture_output=True)
    assert os.path.exists("/dev/infiniband/rdma_cm"), "no /dev/infiniband/rdma_cm (rdma_ucm)"
    assert IP is not None, f"{DEV} has no IPv4 address in its GID table"


@pytest.fixture
def hw():
    """The hardware backend for rdma_cm (and verbs), as SOFTRDMA_BACKEND=ibverbs."""
    set_backend("ibverbs")
    yield
    set_backend(None)


def _ev(ch, want: int, timeout: float = 10.0):
    ev = ch.get_cm_event(timeout)
    assert ev.event_type == want, f"{ev.event_str()} (status {ev.status}), not {want}"
    return ev


class Connected:
    """A listener, a client and the accepted id, connected in the event style."""

    def __init__(self, port: int, req_data: bytes = b"hello-cm", rep_data: bytes = b"welcome"):
        self.port = port
        self.sch, self.cch = CMEventChannel(), CMEventChannel()
        self.lis = CMID(self.sch)
        self.lis.bind_addr(AddrInfo(src=IP, src_service=str(port), flags=RAI_PASSIVE))
        self.lis.listen()
        self.cli = CMID(self.cch)
        self.cli.resolve_addr(AddrInfo(dst=IP, dst_service=str(port)))
        _ev(self.cch, EV.RDMA_CM_EVENT_ADDR_RESOLVED)
        self.cli.resolve_route()
        _ev(self.cch, EV.RDMA_CM_EVENT_ROUTE_RESOLVED)
        self.cli.create_qp(RC)
        cp = ConnParam(data_len=len(req_data))
        cp.set_private_data(req_data)
        self.cli.connect(cp)
        self.req = _ev(self.sch, EV.RDMA_CM_EVENT_CONNECT_REQUEST)
        self.child = CMID(self.req, listen_id=self.lis)
        self.child.create_qp(RC)
        self.rx = self.child.reg_msgs(4096)
        self.child.post_recv(self.rx)
        cp = ConnParam(data_len=len(rep_data))
        cp.set_private_data(rep_data)
        self.child.accept(cp)
        self.rep = _ev(self.cch, EV.RDMA_CM_EVENT_ESTABLISHED)
        _ev(self.sch, EV.RDMA_CM_EVENT_ESTABLISHED)

    def close(self) -> None:
        for x in (self.cli, self.child, self.lis, self.sch, self.cch):
            x.close()


# ---- choosing the backend ---------------------------------------------------------------------

def test_the_backend_decides_and_events_and_ids_follow_their_channel(hw):
    with CMEventChannel() as ch:
        assert isinstance(ch, cma.CMEventChannel)
        with CMID(ch) as cid:
            assert isinstance(cid, cma.CMID)
    set_backend("soft")
    with CMEventChannel() as ch:
        assert isinstance(ch, soft_cmid.CMEventChannel)
        with CMID(ch) as cid:
            assert isinstance(cid, soft_cmid.CMID)


def test_auto_takes_the_device_for_an_address_it_holds():
    set_backend("auto")
    try:
        with CMEventChannel() as ch:  # no address yet: soft, as Context() is
            assert isinstance(ch, soft_cmid.CMEventChannel)
        with CMID(AddrInfo(src=IP, src_service=str(next(PORTS)), flags=RAI_PASSIVE)) as cid:
            assert isinstance(cid, cma.CMID) and cid.dev_name == DEV
        # (a soft id here would open the soft device, whose UDP 4791 kernel rxe holds)
        assert not cma_select.on_hardware(AddrInfo(src="127.0.0.1", flags=RAI_PASSIVE))
        assert not cma_select.on_hardware(AddrInfo(dst=IP, dst_service="1"))  # no src
    finally:
        set_backend(None)


# ---- the event style --------------------------------------------------------------------------

def test_connect_accept_private_data_send_and_disconnect(hw):
    c = Connected(next(PORTS))
    try:
        assert c.req.private_data[:8] == b"hello-cm"
        assert c.rep.private_data[:7] == b"welcome"
        assert c.cli.dev_name == c.child.dev_name == DEV
        assert c.cli.qp.state == c.child.qp.state == E.IBV_QPS_RTS
        tx = c.cli.reg_msgs(64)
        tx.write(b"ping", 4, 0)
        c.cli.post_send(tx, length=4)
        wc = c.cli.get_send_comp(10)
        assert wc.status == E.IBV_WC_SUCCESS and wc.opcode == E.IBV_WC_SEND
        wc = c.child.get_recv_comp(10)
        assert wc.status == E.IBV_WC_SUCCESS and wc.byte_len == 4
        assert c.rx.read(4, 0) == b"ping"
        c.cli.disconnect()
        _ev(c.sch, EV.RDMA_CM_EVENT_DISCONNECTED)
        c.child.disconnect()  # DREP: the active side's DISCONNECTED comes now
        _ev(c.cch, EV.RDMA_CM_EVENT_DISCONNECTED)
        assert c.cli.qp.state == E.IBV_QPS_ERR
    finally:
        c.close()


def test_addresses_and_the_path_ack_timeout(hw):
    port = next(PORTS)
    c = Connected(port)
    try:
        cport = c.cli.local_addr[1]
        assert c.cli.local_addr == (IP, cport) and cport not in (0, port)
        assert c.cli.peer_addr == (IP, port)
        assert c.child.local_addr == (IP, port)
        assert c.child.peer_addr == (IP, cport)
        assert c.lis.local_addr == (IP, port)
        # the REQ's local ACK timeout: packet lifetime + 1, the same on both ends
        assert 0 < c.cli.path_ack_timeout == c.child.path_ack_timeout <= 31
    finally:
        c.close()


def test_an_events_id_is_the_cmids_own(hw):
    c = Connected(next(PORTS))
    try:
        assert c.req.id is c.child.id and c.req.listen_id is c.lis.id
        assert c.rep.id is c.cli.id
    finally:
        c.close()


def test_migrate_moves_the_ids_events(hw):
    port = next(PORTS)
    sch, cch, other = CMEventChannel(), CMEventChannel(), CMEventChannel()
    lis, cli = CMID(sch), CMID(cch)
    child = None
    try:
        lis.bind_addr(AddrInfo(src=IP, src_service=str(port), flags=RAI_PASSIVE))
        lis.listen()
        cli.resolve_addr(AddrInfo(dst=IP, dst_service=str(port)))
        _ev(cch, EV.RDMA_CM_EVENT_ADDR_RESOLVED)
        cli.resolve_route()
        _ev(cch, EV.RDMA_CM_EVENT_ROUTE_RESOLVED)
        cli.create_qp(RC)
        cli.connect(ConnParam())
        child = CMID(_ev(sch, EV.RDMA_CM_EVENT_CONNECT_REQUEST), listen_id=lis)
        child.migrate(other)
        assert child.event_channel is other
        child.create_qp(RC)
        child.accept(ConnParam())
        _ev(cch, EV.RDMA_CM_EVENT_ESTABLISHED)
        assert other.wait(10) and not sch.wait(0.2)
        _ev(other, EV.RDMA_CM_EVENT_ESTABLISHED)
    finally:
        for x in (cli, child, lis, sch, cch, other):
            if x is not None:
                x.close()


def test_reject_carries_private_data_and_refuses(hw):
    port = next(PORTS)
    sch, cch = CMEventChannel(), CMEventChannel()
    lis, cli = CMID(sch), CMID(cch)
    try:
        lis.bind_addr(AddrInfo(src=IP, src_service=str(port), flags=RAI_PASSIVE))
        lis.listen()
        cli.resolve_addr(AddrInfo(dst=IP, dst_service=str(port)))
        _ev(cch, EV.RDMA_CM_EVENT_ADDR_RESOLVED)
        cli.resolve_route()
        _ev(cch, EV.RDMA_CM_EVENT_ROUTE_RESOLVED)
        cli.create_qp(RC)
        cli.connect(ConnParam())
        req = _ev(sch, EV.RDMA_CM_EVENT_CONNECT_REQUEST)
        CMID(req, listen_id=lis).reject(b"go away")
        ev = _ev(cch, EV.RDMA_CM_EVENT_REJECTED)
        assert ev.private_data[:7] == b"go away" and ev.status != 0
    finally:
        for x in (cli, lis, sch, cch):
            x.close()


def test_ud_service_resolution_and_a_datagram(hw):
    """RDMA_PS_UDP: SIDR REQ/REP; the client's ESTABLISHED carries the service's QPN,
    Q_Key and address vector."""
    port = next(PORTS)
    ud_qp = QPInitAttr(qp_type=E.IBV_QPT_UD, cap=QPCap(max_send_wr=4, max_recv_wr=4))
    sch, cch = CMEventChannel(), CMEventChannel()
    lis, cli = CMID(sch, port_space=RDMA_PS_UDP), CMID(cch, port_space=RDMA_PS_UDP)
    srv = None
    try:
        lis.bind_addr(AddrInfo(src=IP, src_service=str(port), flags=RAI_PASSIVE,
                               port_space=RDMA_PS_UDP))
        lis.listen()
        cli.resolve_addr(AddrInfo(dst=IP, dst_service=str(port), port_space=RDMA_PS_UDP))
        _ev(cch, EV.RDMA_CM_EVENT_ADDR_RESOLVED)
        cli.resolve_route()
        _ev(cch, EV.RDMA_CM_EVENT_ROUTE_RESOLVED)
        cli.create_qp(ud_qp)
        assert cli.qp.state == E.IBV_QPS_RTS
        cli.connect(ConnParam())
        srv = CMID(_ev(sch, EV.RDMA_CM_EVENT_CONNECT_REQUEST), listen_id=lis)
        srv.create_qp(ud_qp)
        rx = srv.reg_msgs(128)
        srv.post_recv(rx)
        srv.accept(ConnParam())
        ud = UDParam(_ev(cch, EV.RDMA_CM_EVENT_ESTABLISHED))
        assert ud.qp_num == srv.qpn and ud.qkey == RDMA_UDP_QKEY
        ah = AH(cli.pd, attr=ud.ah_attr)
        tx = cli.reg_msgs(64)
        tx.write(b"datagram", 8, 0)
        cli.post_ud_send(tx, ah, ud.qp_num, length=8)
        assert cli.get_send_comp(10).status == E.IBV_WC_SUCCESS
        wc = srv.get_recv_comp(10)
        assert wc.status == E.IBV_WC_SUCCESS and wc.byte_len == 40 + 8
        assert rx.read(8, 40) == b"datagram"
        ah.close()
    finally:
        for x in (cli, srv, lis, sch, cch):
            if x is not None:
                x.close()


# ---- the synchronous style (rdma_create_ep) --------------------------------------------------

def test_synchronous_style_both_ends(hw):
    port = next(PORTS)
    lis = CMID(AddrInfo(src=IP, src_service=str(port), flags=RAI_PASSIVE), RC)
    lis.listen()
    got: dict = {}

    def serve():
        try:
            conn = lis.get_request(20)
            mr = conn.reg_msgs(64)
            conn.post_recv(mr)
            conn.accept()
            got["wc"] = conn.get_recv_comp(20)
            got["data"] = mr.read(5, 0)
            conn.disconnect()
            conn.close()
        except BaseException as e:  # reported by the main thread
            got["error"] = e

    t = threading.Thread(target=serve)
    t.start()
    cli = CMID(AddrInfo(dst=IP, dst_service=str(port)), RC)
    try:
        cli.connect()
        mr = cli.reg_msgs(64)
        mr.write(b"hello", 5, 0)
        cli.post_send(mr, length=5)
        assert cli.get_send_comp(20).status == E.IBV_WC_SUCCESS
        t.join(30)
        assert "error" not in got, got.get("error")
        assert got["wc"].status == E.IBV_WC_SUCCESS and got["data"] == b"hello"
    finally:
        cli.close()
        lis.close()


def test_nobody_listening_is_econnrefused(hw):
    with pytest.raises(PyverbsRDMAError) as ei:
        with CMID(AddrInfo(dst=IP, dst_service=str(next(PORTS))), RC) as cli:
            cli.connect()
    assert ei.value.error_code == errno.ECONNREFUSED


def test_errors_carry_librdmacm_errnos(hw):
    with CMEventChannel() as ch:
        cid = CMID(ch)
        with pytest.raises(PyverbsRDMAError) as ei:  # an address no device of ours holds
            cid.bind_addr(AddrInfo(src="192.0.2.77", src_service="7000", flags=RAI_PASSIVE))
        assert ei.value.error_code == errno.EADDRNOTAVAIL
        with pytest.raises(PyverbsRDMAError) as ei:
            cid.set_option(RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, 32)
        assert ei.value.error_code == errno.EINVAL
        with pytest.raises(PyverbsRDMAError) as ei:
            ch.get_cm_event(0.05)
        assert ei.value.error_code == errno.ETIMEDOUT
        with pytest.raises(PyverbsRDMAError) as ei:
            cid.create_qp(RC)  # no device before bind/resolve
        assert ei.value.error_code == errno.EINVAL
        cid.close()
        with pytest.raises(PyverbsRDMAError) as ei:
            cid.listen()
        assert ei.value.error_code == errno.EBADF


# ---- the socket layer, unchanged --------------------------------------------------------------

def test_message_socket_echo_on_the_device(hw):
    port = next(PORTS)
    srv = rsock.create_server((IP, port))
    assert isinstance(srv._id, cma.CMID)
    out: dict = {}

    def serve():
        try:
            conn, out["peer"] = srv.accept()
            conn.settimeout(60)
            n = 0
            try:
                while True:
                    conn.send(conn.recv())
                    n += 1
            except EOFError:
                pass
            conn.close()
            out["n"] = n
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=serve)
    t.start()
    rnd = random.Random(5)
    sizes = [0, 1, 31, 4096, 4097, 65536, 1 << 20]
    try:
        with rsock.create_connection((IP, port)) as s:
            s.settimeout(60)
            assert s.getpeername() == (IP, port) and s.getsockname()[0] == IP
            for size in sizes:
                data = rnd.randbytes(size)
                assert s.send(data) == size
                assert s.recv() == data
            cport = s.getsockname()[1]
        t.join(60)
        assert "error" not in out, out.get("error")
        assert out["n"] == len(sizes) and out["peer"] == (IP, cport)
    finally:
        srv.close()


def test_connection_refused_is_pythons(hw):
    with pytest.raises(ConnectionRefusedError):
        rsock.create_connection((IP, next(PORTS)), timeout=20)


def test_message_queue_keeps_each_senders_order_and_runs(hw):
    port = next(PORTS)
    rx = Receiver((IP, port))
    errors: list = []

    def sender(tag: bytes):
        try:
            with rsock.create_connection((IP, port)) as s:
                s.settimeout(60)
                for i in range(20):
                    s.send(tag + b"%d" % i)
                s.send(tag + b"-a", more=True)
                s.send(tag + b"-b")
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=sender, args=(t,)) for t in (b"x", b"y")]
    for t in ts:
        t.start()
    got: dict = {}
    try:
        deadline = time.monotonic() + 60
        while sum(len(v) for v in got.values()) < 44 and time.monotonic() < deadline:
            m = rx.recv(timeout=5)
            got.setdefault(m.sender, []).append((m.data, m.more))
        for t in ts:
            t.join(30)
        assert not errors, errors
        assert len(got) == 2
        for msgs in got.values():
            tag = msgs[0][0][:1]
            assert msgs == [(tag + b"%d" % i, False) for i in range(20)] + \
                [(tag + b"-a", True), (tag + b"-b", False)]
    finally:
        rx.close()


def test_rsocket_stream_on_the_device(hw):
    port = next(PORTS)
    srv = RSocket()
    srv.bind((IP, port))
    srv.listen(4)
    data = random.Random(9).randbytes(300_000)
    out: dict = {}

    def serve():
        try:
            conn, _ = srv.accept()
            conn.settimeout(60)
            buf = bytearray()
            while len(buf) < len(data):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                buf += chunk
            conn.sendall(bytes(buf[::-1]))
            out["got"] = bytes(buf)
            conn.close()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=serve)
    t.start()
    try:
        with RSocket() as s:
            s.settimeout(60)
            s.connect((IP, port))
            s.sendall(data)
            back = bytearray()
            while len(back) < len(data):
                chunk = s.recv(65536)
                assert chunk, "EOF before the whole answer"
                back += chunk
        t.join(60)
        assert "error" not in out, out.get("error")
        assert out["got"] == data and bytes(back) == data[::-1]
    finally:
        srv.close()
