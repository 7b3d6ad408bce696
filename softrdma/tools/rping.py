"""``softrdma rping``: librdmacm's rping (librdmacm/examples/rping.c), on softrdma.

Same port space and port (RDMA_PS_TCP, 7174), same connection parameters (responder
resources 1, initiator depth 1, retry 7, RNR retry 7; the server accepts with NULL), same
data protocol, so either side can be the unmodified rping on a Linux rxe host:

* the client SENDs a 16-byte ``{be64 buf, be32 rkey, be32 size}`` naming its *start*
  buffer; the server RDMA READs ``size`` bytes from it, then SENDs a 16-byte "go ahead"
  (all zeros);
* the client SENDs the same record for its *rdma sink* buffer; the server RDMA WRITEs
  ``strlen + 1`` of what it read into it, then SENDs "go ahead" again;
* the ping data is ``"rdma-ping-%d: "`` followed by a rotating run of the ASCII characters
  65..122 (``A``..``z``), starting one later on each ping, NUL-terminated at ``size - 1``;
* ``-C N`` makes the client ping N times (0 or absent: for ever), then disconnect; the
  server serves one client until it disconnects, or with ``-P`` (persistent) one client
  after another for ever (rping serves them at once, a thread each; softrdma in turn, the
  others' requests waiting meanwhile, held by the CM's MRA).

Output as rping prints it: ``-v`` gives ``ping data: rdma-ping-N: ...`` on the client,
``server ping data: ...`` on the server; ``-V`` compares what came back with what was sent
(``data mismatch!``, exit status 1); ``-d`` adds rping's debug lines. Errors rping prints
and exits on (``cma event RDMA_CM_EVENT_REJECTED, error 8`` when no one listens on the
port) are one line on stderr, exit status 1.
"""

from __future__ import annotations

import argparse
import socket
import struct
import sys
from typing import Any

from ..readiness import readable
from ..enums import (
    IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_WRITE, IBV_QPT_RC,
    IBV_SEND_SIGNALED, IBV_WC_RDMA_READ, IBV_WC_RDMA_WRITE, IBV_WC_RECV, IBV_WC_SEND,
    IBV_WC_WR_FLUSH_ERR, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE, IBV_WR_SEND,
)
from ..errors import PyverbsRDMAError
from ..rdmacm import (
    RAI_PASSIVE, RDMA_PS_TCP, AddrInfo, CMEvent, CMEventChannel, CMID, ConnParam, event_str,
)
from ..rdmacm.enums import rdma_cm_event_type as E
from .common import ToolError, UsageError, add_fault_option, cm_device_for

__all__ = ["add_parser", "run", "ping_data"]

# rping.c's test states, same numbers (they appear in its error messages)
IDLE, CONNECT_REQUEST, ADDR_RESOLVED, ROUTE_RESOLVED, CONNECTED, RDMA_READ_ADV, \
    RDMA_READ_COMPLETE, RDMA_WRITE_ADV, RDMA_WRITE_COMPLETE, DISCONNECTED, ERROR = range(1, 12)

RPING_PORT = 7174
RPING_BUFSIZE = 64 * 1024
RPING_SQ_DEPTH = 16
#: sizeof(stringify(INT_MAX)) + sizeof("rdma-ping-%d: ")
RPING_MIN_BUFSIZE = 11 + 15
INFO = struct.Struct(">QII")  # struct rping_rdma_info {be64 buf; be32 rkey; be32 size}


def ping_data(ping: int, size: int) -> bytes:
    """The ``size`` bytes rping's client puts in its start buffer for ping ``ping``."""
    buf = bytearray(size)
    head = (b"rdma-ping-%d: " % ping)[:max(size - 1, 0)]  # snprintf(buf, size, ...)
    buf[:len(head)] = head
    c = 65 + ping % 58  # start: 65, one more per ping, back to 65 after 122
    for i in range(len(head), size):
        buf[i] = c
        c = 65 if c >= 122 else c + 1
    if size:
        buf[size - 1] = 0
    return bytes(buf)


def cstr(data: bytes) -> str:
    """What printf's %s prints of a buffer: up to its first NUL."""
    return data.split(b"\0", 1)[0].decode("latin-1")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "rping", help="librdmacm's rping: RDMA READ/WRITE ping over rdma_cm (port 7174)",
        description="rping, as librdmacm's: the client advertises a buffer, the server RDMA "
                    "READs it and RDMA WRITEs it back into a second one, COUNT times. "
                    "Interoperates with rping on a Linux RDMA host.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("-s", dest="server", action="store_const", const=True,
                      help="server side. To bind to any address with IPv6 use -a ::0")
    mode.add_argument("-c", dest="server", action="store_const", const=False,
                      help="client side")
    p.add_argument("-a", dest="addr", metavar="addr",
                   help="address (server: the one to listen on, default any; client: the "
                        "server's)")
    p.add_argument("-I", dest="src", metavar="addr",
                   help="Source address to bind to for client.")
    p.add_argument("-p", dest="port", type=_port, default=RPING_PORT, metavar="port",
                   help=f"port ({RPING_PORT})")
    p.add_argument("-C", dest="count", type=_int, default=0, metavar="count",
                   help="ping count times (0: for ever)")
    p.add_argument("-S", dest="size", type=_int, default=64, metavar="size",
                   help=f"ping data size ({RPING_MIN_BUFSIZE} to {RPING_BUFSIZE - 1}, 64)")
    p.add_argument("-v", dest="verbose", action="count", default=0,
                   help="display ping data to stdout")
    p.add_argument("-V", dest="validate", action="count", default=0,
                   help="validate ping data")
    p.add_argument("-d", dest="debug", action="count", default=0, help="debug printfs")
    p.add_argument("-P", dest="persistent", action="store_true",
                   help="persistent server mode allowing multiple connections (served one "
                        "after the other)")
    add_fault_option(p)
    p.set_defaults(func=run)


def _int(text: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer: {text!r}") from None


def _port(text: str) -> int:
    v = _int(text)
    if not 0 < v <= 0xFFFF:
        raise argparse.ArgumentTypeError(f"{text} is not a port number (1..65535)")
    return v


def _get_addr(host: str) -> str:
    try:
        return socket.getaddrinfo(host, None, 0, socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as e:
        raise ToolError(f"getaddrinfo failed ({e.strerror}) - invalid hostname or IP "
                        f"address") from None


def run(a: argparse.Namespace) -> int:
    if a.server is None:
        raise UsageError("one of -s (server) or -c (client) is required")
    if not RPING_MIN_BUFSIZE <= a.size <= RPING_BUFSIZE - 1:
        raise UsageError(f"Invalid size {a.size} (valid range is {RPING_MIN_BUFSIZE} to "
                         f"{RPING_BUFSIZE})")
    if a.count < 0:
        raise UsageError(f"Invalid count {a.count}")
    if not a.server and a.addr is None:
        raise UsageError("the client needs the server's address (-a addr)")
    addr = _get_addr(a.addr) if a.addr is not None else None
    src = _get_addr(a.src) if a.src is not None else None
    cm_device_for(addr if a.server else src)
    cb = _Rping(a, addr, src)
    try:
        if a.server:
            return cb.run_persistent_server() if a.persistent else cb.run_server()
        return cb.run_client()
    finally:
        cb.close()


class _Rping:
    """rping's control block, single-threaded: what its CM thread and CQ thread do is
    done by :meth:`pump`, in the order events arrive; ``sem`` counts the posts of rping's
    semaphore."""

    def __init__(self, a: argparse.Namespace, addr: str | None, src: str | None) -> None:
        self.a = a
        self.server = a.server
        self.addr, self.src = addr, src
        self.size = a.size
        self.state = IDLE
        self.sem = 0
        self.channel = CMEventChannel()
        self.cm_id = CMID(self.channel, port_space=RDMA_PS_TCP)
        self.child: CMID | None = None
        self.req_event: CMEvent | None = None
        self.queued: list[CMEvent] = []  # -P: requests waiting for their turn
        self.conn_id: CMID | None = None  # the id the QP is on
        self.pd = self.comp = self.cq = self.qp = None
        self.mrs: list[Any] = []
        self.remote = (0, 0, 0)  # rkey, addr, len
        self.dbg(f"created cm_id {self.cm_id.id!r}")

    def dbg(self, msg: str) -> None:
        if self.a.debug:
            print(msg, flush=True)

    # ---- the event loop (rping's cm_thread and cq_thread) -------------------------------

    def pump(self, timeout: float = 0.1) -> None:
        fds = [self.channel.fd] + ([self.comp.fd] if self.comp is not None else [])
        ready = readable(fds, timeout)
        if self.comp is not None and self.comp.fd in ready:
            try:
                self.comp.get_cq_event(self.cq, timeout=0)
                self.cq.ack_events(1)
            except PyverbsRDMAError:
                pass
        if self.cq is not None:
            self.cq.req_notify()
            self._cq_events()
        while self.channel.pending():
            self._cma_event(CMEvent(self.channel, 0))

    def sem_wait(self) -> None:
        while self.sem == 0:
            self.pump()
        self.sem -= 1

    def _cma_event(self, ev: CMEvent) -> None:
        t = ev.event_type
        parent = ev.id is self.cm_id.id
        if not parent and t != E.RDMA_CM_EVENT_CONNECT_REQUEST and (
                self.child is None or ev.id is not self.child.id):
            return  # -P: a connection already served and gone
        self.dbg(f"cma_event type {event_str(t)} cma_id {ev.id!r} "
                 f"({'parent' if parent else 'child'})")
        if t == E.RDMA_CM_EVENT_ADDR_RESOLVED:
            self.state = ADDR_RESOLVED
            try:
                self.cm_id.resolve_route(2000)
            except PyverbsRDMAError as e:
                self.state = ERROR
                print(f"rdma_resolve_route: {e}", file=sys.stderr)
                self.sem += 1
        elif t == E.RDMA_CM_EVENT_ROUTE_RESOLVED:
            self.state = ROUTE_RESOLVED
            self.sem += 1
        elif t == E.RDMA_CM_EVENT_CONNECT_REQUEST:
            if self.req_event is not None:  # rping blocks on its accept_ready semaphore
                self.queued.append(ev)
                return
            self.state = CONNECT_REQUEST
            self.req_event = ev
            self.child = CMID(ev, listen_id=self.cm_id)
            self.dbg(f"child cma {ev.id!r}")
            self.sem += 1
        elif t == E.RDMA_CM_EVENT_CONNECT_RESPONSE:
            self.dbg("CONNECT_RESPONSE")
            self.state = CONNECTED
            self.sem += 1
        elif t == E.RDMA_CM_EVENT_ESTABLISHED:
            self.dbg("ESTABLISHED")
            if not self.server:
                self.state = CONNECTED
            self.sem += 1
        elif t in (E.RDMA_CM_EVENT_ADDR_ERROR, E.RDMA_CM_EVENT_ROUTE_ERROR,
                   E.RDMA_CM_EVENT_CONNECT_ERROR, E.RDMA_CM_EVENT_UNREACHABLE,
                   E.RDMA_CM_EVENT_REJECTED):
            # rping prints this and exits from its CM thread (status -1)
            raise ToolError(f"cma event {event_str(t)}, error {ev.status}")
        elif t == E.RDMA_CM_EVENT_DISCONNECTED:
            print(f"{'server' if self.server else 'client'} DISCONNECT EVENT...",
                  file=sys.stderr, flush=True)
            self.state = DISCONNECTED
            self.sem += 1
        elif t == E.RDMA_CM_EVENT_DEVICE_REMOVAL:
            raise ToolError("cma detected device removal!!!!")
        else:
            print(f"unhandled event: {event_str(t)}, ignoring", file=sys.stderr)

    def _cq_events(self) -> None:
        while True:
            n, wcs = self.cq.poll(1)
            if not n:
                return
            wc = wcs[0]
            if wc.status:
                if wc.status == IBV_WC_WR_FLUSH_ERR:
                    continue
                print(f"cq completion failed status {wc.status}", file=sys.stderr)
                self._error()
                return
            if wc.opcode == IBV_WC_SEND:
                self.dbg("send completion")
            elif wc.opcode == IBV_WC_RDMA_WRITE:
                self.dbg("rdma write completion")
                self.state = RDMA_WRITE_COMPLETE
                self.sem += 1
            elif wc.opcode == IBV_WC_RDMA_READ:
                self.dbg("rdma read completion")
                self.state = RDMA_READ_COMPLETE
                self.sem += 1
            elif wc.opcode == IBV_WC_RECV:
                self.dbg("recv completion")
                if not self._recv(wc):
                    print("recv wc error: -1", file=sys.stderr)
                    self._error()
                    return
                self.post_recv()
                self.sem += 1
            else:
                self.dbg("unknown!!!!! completion")
                self._error()
                return

    def _error(self) -> None:
        self.state = ERROR
        self.sem += 1

    def _recv(self, wc: Any) -> bool:
        if wc.byte_len != INFO.size:
            print(f"Received bogus data, size {wc.byte_len}", file=sys.stderr)
            return False
        if self.server:
            buf, rkey, size = INFO.unpack(self.recv_mr.read(INFO.size, 0))
            self.remote = (rkey, buf, size)
            self.dbg(f"Received rkey {rkey:x} addr {buf:x} len {size} from peer")
            if self.state <= CONNECTED or self.state == RDMA_WRITE_COMPLETE:
                self.state = RDMA_READ_ADV
            else:
                self.state = RDMA_WRITE_ADV
        else:
            self.state = RDMA_WRITE_ADV if self.state == RDMA_READ_ADV else RDMA_WRITE_COMPLETE
        return True

    # ---- resources ----------------------------------------------------------------------

    def setup_qp(self, cmid: CMID) -> None:
        from ..verbs_api import CQ, MR, PD, CompChannel, QPCap, QPInitAttr
        ctx = cmid.context
        self.pd = PD(ctx)
        self.dbg(f"created pd {self.pd!r}")
        self.comp = CompChannel(ctx)
        self.cq = CQ(ctx, RPING_SQ_DEPTH * 2, None, self.comp, 0)
        self.cq.req_notify()
        cmid.pd = self.pd
        cmid.create_qp(QPInitAttr(qp_type=IBV_QPT_RC, scq=self.cq, rcq=self.cq,
                                  cap=QPCap(max_send_wr=RPING_SQ_DEPTH, max_recv_wr=2,
                                            max_send_sge=1, max_recv_sge=1)))
        self.qp = cmid.qp
        self.conn_id = cmid
        self.dbg(f"created qp {self.qp!r}")
        rw = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE
        self.recv_mr = MR(self.pd, INFO.size, IBV_ACCESS_LOCAL_WRITE)
        self.send_mr = MR(self.pd, INFO.size, 0)
        self.rdma_mr = MR(self.pd, self.size, rw)
        self.mrs = [self.recv_mr, self.send_mr, self.rdma_mr]
        if not self.server:
            self.start_mr = MR(self.pd, self.size, rw)
            self.mrs.append(self.start_mr)
        self.dbg("allocated & registered buffers...")
        self.post_recv()

    def post_recv(self) -> None:
        from ..verbs_api import SGE, RecvWR
        self.qp.post_recv(RecvWR(0, 1, [SGE(self.recv_mr.buf, INFO.size, self.recv_mr.lkey)]))

    def post_info(self, mr: Any | None) -> None:
        """SEND the 16-byte record: ``mr``'s address, rkey and our size (None: the
        server's "go ahead", whatever its send buffer holds: zeros)."""
        from ..verbs_api import SGE, SendWR
        if mr is not None:
            self.send_mr.write(INFO.pack(mr.buf, mr.rkey, self.size), INFO.size, 0)
            self.dbg(f"RDMA addr {mr.buf:x} rkey {mr.rkey:x} len {self.size}")
        self.qp.post_send(SendWR(0, IBV_WR_SEND, 1, sg=[SGE(self.send_mr.buf, INFO.size,
                                                           self.send_mr.lkey)],
                                 send_flags=IBV_SEND_SIGNALED))

    def post_rdma(self, opcode: int, length: int) -> None:
        from ..verbs_api import SGE, SendWR
        rkey, addr, _ = self.remote
        wr = SendWR(0, opcode, 1, sg=[SGE(self.rdma_mr.buf, length, self.rdma_mr.lkey)],
                    send_flags=IBV_SEND_SIGNALED)
        wr.set_wr_rdma(rkey, addr)
        self.qp.post_send(wr)

    def close(self) -> None:
        for cmid in (self.child, self.cm_id):
            if cmid is not None:
                try:
                    cmid.close()
                except Exception:
                    pass
        for obj in reversed(self.mrs):
            obj.close()
        for obj in (self.cq, self.comp, self.pd):
            if obj is not None:
                try:
                    obj.close()
                except Exception:
                    pass
        self.channel.close()

    # ---- server -------------------------------------------------------------------------

    def run_server(self) -> int:
        a = self.a
        self.cm_id.bind_addr(AddrInfo(src=self.addr, src_service=a.port, flags=RAI_PASSIVE))
        self.dbg("rdma_bind_addr successful")
        self.dbg("rdma_listen")
        self.cm_id.listen(3)
        self.sem_wait()
        if self.state != CONNECT_REQUEST:
            raise ToolError(f"wait for CONNECT_REQUEST state {self.state}")
        self.setup_qp(self.child)
        self.dbg("accepting client connection request")
        self.child.accept(None)
        self.sem_wait()
        if self.state == ERROR:
            raise ToolError(f"wait for CONNECTED state {self.state}")
        try:
            ret = self.test_server()
            if ret:
                raise ToolError(f"rping server failed: {ret}")
        finally:
            try:
                self.child.disconnect()
            except PyverbsRDMAError:
                pass
        return 0

    def test_server(self) -> int:
        while True:
            self.sem_wait()
            if self.state != RDMA_READ_ADV:
                print(f"wait for RDMA_READ_ADV state {self.state}", file=sys.stderr)
                break
            self.dbg("server received sink adv")
            self.post_rdma(IBV_WR_RDMA_READ, self.remote[2])
            self.dbg("server posted rdma read req ")
            self.sem_wait()
            if self.state != RDMA_READ_COMPLETE:
                print(f"wait for RDMA_READ_COMPLETE state {self.state}", file=sys.stderr)
                break
            self.dbg("server received read complete")
            data = self.rdma_mr.read(self.size, 0)
            if self.a.verbose:
                print(f"server ping data: {cstr(data)}", flush=True)
            self.post_info(None)
            self.dbg("server posted go ahead")
            self.sem_wait()
            if self.state != RDMA_WRITE_ADV:
                print(f"wait for RDMA_WRITE_ADV state {self.state}", file=sys.stderr)
                break
            self.dbg("server received sink adv")
            n = len(cstr(data)) + 1
            self.dbg(f"rdma write from lkey {self.rdma_mr.lkey:x} laddr {self.rdma_mr.buf:x} "
                     f"len {n}")
            self.post_rdma(IBV_WR_RDMA_WRITE, n)
            self.sem_wait()
            if self.state != RDMA_WRITE_COMPLETE:
                print(f"wait for RDMA_WRITE_COMPLETE state {self.state}", file=sys.stderr)
                break
            self.dbg("server rdma write complete ")
            self.post_info(None)
            self.dbg("server posted go ahead")
        return 0 if self.state == DISCONNECTED else -1

    def run_persistent_server(self) -> int:
        """rping -P: accept connections for ever, each served until its client
        disconnects; a failed one is reported and the server goes on."""
        self.cm_id.bind_addr(AddrInfo(src=self.addr, src_service=self.a.port,
                                      flags=RAI_PASSIVE))
        self.cm_id.listen(3)
        while True:
            if self.req_event is None and self.queued:
                ev = self.queued.pop(0)
                self.state = CONNECT_REQUEST
                self.req_event = ev
                self.child = CMID(ev, listen_id=self.cm_id)
                self.sem += 1
            self.sem_wait()
            if self.state != CONNECT_REQUEST:
                print(f"wait for CONNECT_REQUEST state {self.state}", file=sys.stderr)
                return 1
            try:
                self.setup_qp(self.child)
                self.child.accept(None)
                self.sem_wait()
                if self.state == ERROR:
                    print(f"wait for CONNECTED state {self.state}", file=sys.stderr)
                else:
                    self.test_server()
                    try:
                        self.child.disconnect()
                    except PyverbsRDMAError:
                        pass
            except (PyverbsRDMAError, ToolError) as e:
                print(f"connect error {e}", file=sys.stderr)
            self._end_connection()

    def _end_connection(self) -> None:
        """Free what one connection used, as rping's persistent server thread does."""
        if self.child is not None:
            self.child.close()
        for obj in reversed(self.mrs):
            obj.close()
        for obj in (self.cq, self.comp, self.pd):
            if obj is not None:
                obj.close()
        self.child = self.req_event = self.conn_id = None
        self.pd = self.comp = self.cq = self.qp = None
        self.mrs = []
        self.state = IDLE
        self.sem = 0

    # ---- client -------------------------------------------------------------------------

    def run_client(self) -> int:
        a = self.a
        self.cm_id.resolve_addr(AddrInfo(src=self.src, dst=self.addr, dst_service=a.port),
                                2000)
        self.sem_wait()
        if self.state != ROUTE_RESOLVED:
            raise ToolError(f"waiting for addr/route resolution state {self.state}")
        self.dbg("rdma_resolve_addr - rdma_resolve_route successful")
        self.setup_qp(self.cm_id)
        self.cm_id.connect(ConnParam(resources=1, depth=1, retry=7, rnr_retry=7))
        self.sem_wait()
        if self.state != CONNECTED:
            raise ToolError(f"wait for CONNECTED state {self.state}")
        self.dbg("rdma_connect successful")
        try:
            ret = self.test_client()
        finally:
            if self.state != DISCONNECTED:
                try:
                    self.cm_id.disconnect()
                    self._await_disconnect()
                except PyverbsRDMAError:
                    pass
        if ret:
            raise ToolError(f"rping client failed: {ret}")
        return 0

    def _await_disconnect(self, timeout: float = 2.0) -> None:
        """rping's CM thread reports the DREP's DISCONNECTED while the client cleans up."""
        import time
        end = time.monotonic() + timeout
        while self.state != DISCONNECTED and time.monotonic() < end:
            self.pump(0.05)

    def test_client(self) -> int:
        count = self.a.count
        ping = 0
        while not count or ping < count:
            self.state = RDMA_READ_ADV
            sent = ping_data(ping, self.size)
            self.start_mr.write(sent, self.size, 0)
            self.post_info(self.start_mr)
            self.sem_wait()
            if self.state != RDMA_WRITE_ADV:
                print(f"wait for RDMA_WRITE_ADV state {self.state}", file=sys.stderr)
                return 0 if self.state == DISCONNECTED else -1
            self.post_info(self.rdma_mr)
            self.sem_wait()
            if self.state != RDMA_WRITE_COMPLETE:
                print(f"wait for RDMA_WRITE_COMPLETE state {self.state}", file=sys.stderr)
                return 0 if self.state == DISCONNECTED else -1
            got = self.rdma_mr.read(self.size, 0)
            if self.a.validate and got != self.start_mr.read(self.size, 0):
                print("data mismatch!", file=sys.stderr)
                return -1
            if self.a.verbose:
                print(f"ping data: {cstr(got)}", flush=True)
            ping += 1
        return 0
