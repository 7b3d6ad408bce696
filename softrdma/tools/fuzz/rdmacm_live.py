"""Live rdma_cm connections for the ``cm`` and ``records`` targets: devices on loopback,
a server that accepts only its own clients, RC connections made and checked.

:class:`CmSides` is two soft devices with their progress threads; device A listens (an RC
id and a UD id on one port) and device B connects to it, both with event channels read
by :meth:`CmSides.pump`, which is also the server application: a CONNECT_REQUEST whose
private data starts with the run's token (one of our own clients) is accepted with a QP,
any other one (a forged REQ or SIDR_REQ) is rejected and its id destroyed at once, as a
careful server does, so what a forged request may make the stack hold is what the CM
and rdma_cm hold by themselves. A connection that ends (DISCONNECTED, REJECTED...) is
disconnected and destroyed on both sides, as an application does.
"""

from __future__ import annotations

import socket
import threading
import time
import traceback
from typing import Any

from ...errors import PyverbsRDMAError
from ...rdmacm import RAI_PASSIVE, AddrInfo, CMEvent, CMEventChannel, CMID, ConnParam
from ...rdmacm import enums as ce
from ...rdmacm.device import CmaDevice
from ...soft.udp import TransportError
from ...verbs_api import QPCap, QPInitAttr
from ...verbs_api.device import add_device, find_device, unregister_device
from ...verbs_api.enums import ibv_qp_type
from ..common import ToolError

__all__ = ["CmSides", "RcConn", "open_devices", "close_devices", "send_socket",
           "ExceptHook", "CONNECT_TIMEOUT", "poll_cq"]

E = ce.rdma_cm_event_type
#: a legitimate connection on loopback takes milliseconds; under load on 2 shared cores a
#: few hundred. 10 s is the "bounded" of the survival check (issue 26 point 1 made it 25 s)
CONNECT_TIMEOUT = 10.0
_ENDED = (E.RDMA_CM_EVENT_DISCONNECTED, E.RDMA_CM_EVENT_REJECTED,
          E.RDMA_CM_EVENT_UNREACHABLE, E.RDMA_CM_EVENT_CONNECT_ERROR,
          E.RDMA_CM_EVENT_ADDR_ERROR, E.RDMA_CM_EVENT_ROUTE_ERROR)


def open_devices(addrs: tuple[str, str], seed: int, raw: bool) -> list[Any]:
    """Two soft devices bound to UDP 4791 on ``addrs`` with their progress threads."""
    devs: list[Any] = []
    for ip in addrs:
        name = f"softrdma-fuzz-{ip}"
        if find_device(name) is not None:
            close_devices(devs)
            raise ToolError(f"device {name} already exists")
        dev = add_device(ip, name=name, seed=seed + len(devs))
        try:
            dev.attach_udp(thread=True, raw_rx=raw)
        except TransportError as e:
            unregister_device(name)
            close_devices(devs)
            raise ToolError(f"cannot bind {ip}: {e.args[1] if len(e.args) > 1 else e}")
        devs.append(dev)
    return devs


def close_devices(devs: list[Any]) -> None:
    for d in devs:
        d.detach()
        unregister_device(d.name)


def send_socket(ip: str) -> socket.socket:
    """A UDP socket bound to ``ip`` with DF (so IP ID 0, what the ICRC assumes)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.setsockopt(socket.IPPROTO_IP, 10, 2)  # IP_MTU_DISCOVER = IP_PMTUDISC_DO
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        s.bind((ip, 0))
    except OSError as e:
        s.close()
        raise ToolError(f"cannot bind a sending socket to {ip}: {e.strerror}") from None
    s.setblocking(False)
    return s


class ExceptHook:
    """Records every exception that escapes a thread (``threading.excepthook``)."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        self.old = threading.excepthook
        threading.excepthook = self._hook

    def _hook(self, args: Any) -> None:
        self.errors.append(
            f"{args.thread.name if args.thread else '?'}: "
            + "".join(traceback.format_exception(args.exc_type, args.exc_value,
                                                 args.exc_traceback)).strip())
        self.old(args)

    def close(self) -> None:
        threading.excepthook = self.old


def poll_cq(cq: Any, timeout: float) -> Any:
    """The next completion of ``cq`` within ``timeout`` seconds, or None. (Polled: a
    live device completes on its own thread; ``CMID.get_send_comp(timeout)`` waits for
    a completion event past its timeout when none comes, see the fuzz report.)"""
    deadline = time.monotonic() + timeout
    while True:
        got, wcs = cq.poll(1)
        if got:
            return wcs[0]
        if time.monotonic() > deadline:
            return None
        time.sleep(0.0002)


def _qp_attr() -> QPInitAttr:
    return QPInitAttr(qp_type=ibv_qp_type.IBV_QPT_RC,
                      cap=QPCap(max_send_wr=16, max_recv_wr=16, max_send_sge=1,
                                max_recv_sge=1))


class RcConn:
    """One legitimate RC connection: the client's CMID on B, the server's on A."""

    def __init__(self, client: CMID) -> None:
        self.client = client
        self.server: CMID | None = None
        self.ended = ""  # why it ended ("" while it is up)

    def exchange(self, data: bytes, timeout: float = 2.0) -> str | None:
        """A SEND each way, data checked; None or what failed."""
        if self.server is None:
            return "no server side"
        for a, b in ((self.client, self.server), (self.server, self.client)):
            try:
                rmr = b.reg_msgs(len(data))
                smr = a.reg_msgs(len(data))
                try:
                    b.post_recv(rmr)
                    smr.write(data, len(data))
                    a.post_send(smr)
                    wc = poll_cq(a.qp.send_cq, timeout)
                    if wc is None or wc.status:
                        return f"send: {'no completion' if wc is None else wc.status}"
                    wc = poll_cq(b.qp.recv_cq, timeout)
                    if wc is None or wc.status:
                        return f"receive: {'no completion' if wc is None else wc.status}"
                    if rmr.read(len(data), 0) != data:
                        return "received data differs"
                finally:
                    rmr.close()
                    smr.close()
            except PyverbsRDMAError as e:
                return f"{e}"
        return None

    def sides(self) -> list[CMID]:
        return [c for c in (self.client, self.server) if c is not None]


class CmSides:
    """Device A listening (RC and UD ids on ``port``), device B connecting to it."""

    def __init__(self, devs: list[Any], port: int, token: bytes) -> None:
        self.devs = devs
        self.a, self.b = devs
        self.port = port
        self.token = token
        self.ch_a = CMEventChannel()
        self.ch_b = CMEventChannel()
        self.cdevs = [CmaDevice.acquire(d) for d in devs]  # the CM state the checks count
        self.listeners: dict[int, CMID] = {}
        for ps in (ce.RDMA_PS_TCP, ce.RDMA_PS_UDP):
            lid = CMID(self.ch_a, port_space=ps)
            lid.bind_addr(AddrInfo(src=self.a.ip, src_service=str(port), port_space=ps,
                                   flags=RAI_PASSIVE))
            lid.listen(16)
            self.listeners[id(lid.id)] = lid
        self.events: dict[int, list[int]] = {}  # by id(RdmaCmId): event types seen
        self.dialing: set[int] = set()  # ids of our clients still resolving
        self.conns: dict[int, RcConn] = {}  # by id(RdmaCmId) of either side
        self.forged_requests = 0
        self.qps_made = 0  # QPs created (each a new QPN, so maybe a source-port socket)
        #: rdma_cm calls that raised something other than PyverbsRDMAError (a verbs or
        #: rdma_cm call fails with PyverbsRDMAError and an errno, or not at all)
        self.app_errors: list[str] = []

    # -- the application ------------------------------------------------------------------
    def pump(self) -> int:
        """Read and handle every queued event on both channels; how many."""
        n = 0
        for ch in (self.ch_a, self.ch_b):
            while ch.pending():
                self._on_event(CMEvent(ch, 0))
                n += 1
        return n

    def _on_event(self, ev: CMEvent) -> None:
        t = ev.event_type
        key = id(ev.id)
        if key in self.conns or key in self.dialing:  # (not the forged requests' ids)
            self.events.setdefault(key, []).append(t)
        if t == E.RDMA_CM_EVENT_CONNECT_REQUEST:
            lid = self.listeners.get(id(ev.listen_id))
            if lid is None:
                return
            child = CMID(ev, listen_id=lid)
            pending = next((c for c in self.conns.values() if c.server is None
                            and ev.private_data.startswith(self.token)
                            and ev.private_data[len(self.token):len(self.token) + 8]
                            == _tag(c)), None)
            if pending is None:
                self.forged_requests += 1
                self._call("rdma_reject", child.reject, b"")
                self._call("rdma_destroy_id", child.close)
                return
            try:
                self.qps_made += 1
                child.create_qp(_qp_attr())
                child.accept(ConnParam(resources=1, depth=1, retry=5, rnr_retry=7))
            except PyverbsRDMAError as e:
                self.app_errors.append(f"accept: {e}")
                child.close()
                return
            pending.server = child
            self.conns[id(child.id)] = pending
            return
        if t in _ENDED or t == E.RDMA_CM_EVENT_TIMEWAIT_EXIT:
            conn = self.conns.get(key)
            if conn is not None and not conn.ended:
                conn.ended = ce.event_str(t)

    def _call(self, what: str, fn: Any, *args: Any) -> None:
        """An rdma_cm call that may fail with PyverbsRDMAError (e.g. the request was
        already rejected by a forged REJ) and with nothing else."""
        try:
            fn(*args)
        except PyverbsRDMAError:
            pass
        except Exception:
            self.app_errors.append(f"{what}: " + traceback.format_exc().strip())

    def wait(self, cmid: CMID, want: int, deadline: float) -> str | None:
        """Pump until ``cmid`` got ``want``; None, or the event that ended it instead."""
        key = id(cmid.id)
        while True:
            self.pump()
            got = self.events.get(key, [])
            if want in got:
                return None
            bad = [t for t in got if t in _ENDED]
            if bad:
                return ce.event_str(bad[0])
            if time.monotonic() > deadline:
                return f"no {ce.event_str(want)} within {CONNECT_TIMEOUT:.0f} s"
            time.sleep(0.002)

    def connect(self) -> tuple[RcConn | None, str | None]:
        """A new legitimate RC connection B -> A, within :data:`CONNECT_TIMEOUT`."""
        deadline = time.monotonic() + CONNECT_TIMEOUT
        c = CMID(self.ch_b)
        conn = RcConn(c)
        self.dialing.add(id(c.id))
        try:
            c.resolve_addr(AddrInfo(src=self.b.ip, dst=self.a.ip, dst_service=str(self.port)))
            err = self.wait(c, E.RDMA_CM_EVENT_ADDR_RESOLVED, deadline)
            if err is None:
                c.resolve_route()
                err = self.wait(c, E.RDMA_CM_EVENT_ROUTE_RESOLVED, deadline)
            if err is None:
                self.qps_made += 1
                c.create_qp(_qp_attr())
                self.conns[id(c.id)] = conn
                cp = ConnParam(resources=1, depth=1, retry=5, rnr_retry=7, data_len=56)
                cp.set_private_data(self.token + _tag(conn))
                c.connect(cp)
                err = self.wait(c, E.RDMA_CM_EVENT_ESTABLISHED, deadline)
        except PyverbsRDMAError as e:
            err = str(e)
        self.dialing.discard(id(c.id))
        if err is None and conn.server is None:
            err = "established without the server's side"
        if err is not None:
            self.drop(conn)
            return None, f"connect: {err}"
        return conn, None

    def drop(self, conn: RcConn) -> None:
        """Disconnect and destroy both sides of a connection."""
        for c in (conn.client, conn.server):
            if c is not None and c.id is not None:
                self.conns.pop(id(c.id), None)
                self.events.pop(id(c.id), None)
        for c in conn.sides():
            self._call("rdma_disconnect", c.disconnect)
            self._call("rdma_destroy_id", c.close)

    def cm_ids(self) -> list[int]:
        """How many CM ids each device's CM holds (listeners included)."""
        return [len(c.service.agent.ids) for c in self.cdevs]

    def close(self) -> None:
        for conn in list({id(c): c for c in self.conns.values()}.values()):
            self.drop(conn)
        self.conns.clear()
        for lid in self.listeners.values():
            lid.close()
        for ch in (self.ch_a, self.ch_b):
            ch.close()
        for c in self.cdevs:
            c.release()


def _tag(conn: RcConn) -> bytes:
    """Eight bytes naming one of our connections in its REQ's private data."""
    return id(conn).to_bytes(8, "little")
