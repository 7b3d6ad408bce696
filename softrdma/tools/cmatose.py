"""``softrdma cmatose``: librdmacm's ucmatose (librdmacm/examples/cmatose.c), on softrdma.

RC connections through rdma_cm on port space TCP, port 7471, with ucmatose's connection
parameters (responder resources 1, initiator depth 1, retry 5, RNR retry 0; the server
accepts with NULL), so either side can be the unmodified ucmatose on a Linux rxe host:

* server (no ``-s``): listens, accepts ``-c`` connections (each with its PD, a send and a
  receive CQ of ``-C`` entries, an RC QP with every send signaled, ``-C`` receives of
  ``-S`` bytes posted before the accept), SENDs ``-C`` messages of ``-S`` bytes on each,
  waits for their completions, then for ``-C`` messages back on each, then disconnects;
* client (``-s server``): resolves and connects ``-c`` ids, receives ``-C`` messages on
  each, SENDs ``-C`` replies, and waits for the server's disconnect.

Output lines and exit status as ucmatose's: ``cmatose: starting server``, ``initiating
data transfers``, ``completing sends``, ``receiving data transfers``, ``data transfers
complete``, ``cmatose: disconnecting``, ``disconnected``, ``test complete``, ``return
status N``; a failed connection prints ``cmatose: event: RDMA_CM_EVENT_REJECTED, error 8``
and the status is the event's. The message contents are zeros (ucmatose sends
uninitialised memory).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..enums import IBV_ACCESS_LOCAL_WRITE, IBV_QPT_RC, IBV_WR_SEND
from ..errors import PyverbsRDMAError
from ..rdmacm import (
    RAI_PASSIVE, RDMA_PS_TCP, AddrInfo, CMEventChannel, CMID, ConnParam, event_str,
)
from ..rdmacm.enums import rdma_cm_event_type as E
from .argtypes import c_int
from .common import ToolError, add_fault_option, cm_device_for

__all__ = ["add_parser", "run"]

NAME = "cmatose"
#: how long a CQ or the event channel may stay silent before the tool gives up (ucmatose
#: waits for ever)
STALL_TIMEOUT = 60.0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "cmatose", help="librdmacm's ucmatose: RC connections and SENDs over rdma_cm (port "
                        "7471)",
        description="ucmatose, as librdmacm's: without -s a server, with -s a client; -c "
                    "connections each exchanging -C messages of -S bytes. Interoperates "
                    "with ucmatose on a Linux RDMA host.")
    common_options(p, port="7471")
    add_fault_option(p)
    p.set_defaults(func=run)


def common_options(p: argparse.ArgumentParser, port: str) -> None:
    """The options cmatose and udaddy share (librdmacm's common.c and the tools' own),
    with ``port`` as the default port."""
    p.add_argument("-s", dest="server_addr", metavar="server_address",
                   help="the server to connect to (without it: be the server)")
    p.add_argument("-b", dest="bind_addr", metavar="bind_address",
                   help="the local address to bind to")
    p.add_argument("-c", dest="connections", type=_atoi, default=1, metavar="connections",
                   help="number of connections (1)")
    p.add_argument("-C", dest="message_count", type=_atoi, default=10,
                   metavar="message_count", help="messages per connection (10)")
    p.add_argument("-S", dest="message_size", type=_atoi, default=100,
                   metavar="message_size", help="message size in bytes (100)")
    p.add_argument("-t", dest="tos", type=c_int, default=None, metavar="type_of_service",
                   help="type of service (IP TOS) of the connections")
    if port == "7471":
        p.add_argument("-p", dest="port", type=port_arg, default=int(port),
                       metavar="port_number", help=f"port number ({port})")


def _atoi(text: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer: {text!r}") from None


def port_arg(text: str) -> int:
    """An argparse ``type``: a port number (0..65535) as the C tools parse it."""
    v = _atoi(text)
    if not 0 <= v <= 0xFFFF:
        raise argparse.ArgumentTypeError(f"{text} is not a port number")
    return v


def check_counts(a: argparse.Namespace) -> None:
    from .common import UsageError
    if a.connections < 1:
        raise UsageError(f"argument -c: {a.connections} is not positive")
    if a.message_count < 0 or a.message_size < 0:
        raise UsageError("arguments -C and -S: negative values are not supported")
    if not a.message_size:
        a.message_count = 0


class Node:
    """``struct cmatest_node``: one connection and its verbs resources."""

    def __init__(self, i: int) -> None:
        self.id = i
        self.cmid: CMID | None = None
        self.connected = False
        self.pd = self.mr = self.ah = None
        self.cqs: list[Any] = []
        self.remote_qpn = 0
        self.remote_qkey = 0

    def destroy(self) -> None:
        if self.cmid is None:
            return
        for obj in [self.ah, self.cmid, *self.cqs, self.mr, self.pd]:
            if obj is not None:
                try:
                    obj.close()
                except Exception:
                    pass


def poll_cq(cq: Any, want: int, on_batch: Any = None) -> None:
    """ucmatose's ``poll_cqs`` for one CQ: ``want`` completions, whatever their status."""
    done = 0
    last = time.monotonic()
    while done < want:
        n, wcs = cq.poll(8)
        if n:
            done += n
            last = time.monotonic()
            if on_batch is not None:
                on_batch(wcs)
        elif time.monotonic() - last > STALL_TIMEOUT:
            raise ToolError(f"no completion for {STALL_TIMEOUT:.0f} s ({done} of {want})")
        else:
            time.sleep(0.0005)


class Test:
    """``struct cmatest`` and what cmatose.c does with it."""

    PS = RDMA_PS_TCP

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.count = a.message_count
        self.size = a.message_size
        self.channel = CMEventChannel()
        self.nodes = [Node(i) for i in range(a.connections)]
        self.by_id: dict[int, Node] = {}
        self.conn_index = 0
        self.connects_left = a.connections
        self.disconnects_left = 0
        if a.server_addr:
            for n in self.nodes:
                n.cmid = CMID(self.channel, port_space=self.PS)
                self.by_id[id(n.cmid.id)] = n

    # ---- verbs resources ----------------------------------------------------------------

    def init_node(self, node: Node) -> None:
        from ..verbs_api import CQ, MR, PD, QPCap, QPInitAttr
        ctx = node.cmid.context
        node.pd = PD(ctx)
        cqe = self.count or 1
        node.cqs = [CQ(ctx, cqe, None, None, 0), CQ(ctx, cqe, None, None, 0)]
        node.cmid.pd = node.pd
        node.cmid.create_qp(QPInitAttr(qp_type=IBV_QPT_RC, scq=node.cqs[0], rcq=node.cqs[1],
                                       sq_sig_all=1,
                                       cap=QPCap(max_send_wr=cqe, max_recv_wr=cqe,
                                                 max_send_sge=1, max_recv_sge=1)))
        if self.count:
            node.mr = MR(node.pd, self.size, IBV_ACCESS_LOCAL_WRITE)

    def post_recvs(self, node: Node) -> None:
        from ..verbs_api import SGE, RecvWR
        for _ in range(self.count):
            node.cmid.qp.post_recv(RecvWR(node.id, 1, [SGE(node.mr.buf, self.size,
                                                           node.mr.lkey)]))

    def post_sends(self, node: Node) -> None:
        from ..verbs_api import SGE, SendWR
        if not node.connected or not self.count:
            return
        for _ in range(self.count):
            node.cmid.qp.post_send(SendWR(node.id, IBV_WR_SEND, 1,
                                          sg=[SGE(node.mr.buf, self.size, node.mr.lkey)],
                                          send_flags=0))

    def poll_cqs(self, index: int) -> None:
        for node in self.nodes:
            if node.connected:
                poll_cq(node.cqs[index], self.count)

    # ---- events -------------------------------------------------------------------------

    def set_tos(self, node: Node) -> None:
        if self.a.tos is not None:
            from ..rdmacm import RDMA_OPTION_ID, RDMA_OPTION_ID_TOS
            node.cmid.set_option(RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, self.a.tos & 0xFF)

    def handler(self, ev: Any) -> int:
        t = ev.event_type
        node = self.by_id.get(id(ev.id))
        if t == E.RDMA_CM_EVENT_ADDR_RESOLVED:
            self.set_tos(node)
            try:
                node.cmid.resolve_route(2000)
            except PyverbsRDMAError as e:
                print(f"{NAME}: resolve route failed: {e}")
                self.connects_left -= 1
                return -1
        elif t == E.RDMA_CM_EVENT_ROUTE_RESOLVED:
            try:
                self.init_node(node)
                self.post_recvs(node)
                node.cmid.connect(ConnParam(resources=1, depth=1, retry=5, rnr_retry=0))
            except PyverbsRDMAError as e:
                print(f"{NAME}: failure connecting: {e}")
                self.connects_left -= 1
                return -1
        elif t == E.RDMA_CM_EVENT_CONNECT_REQUEST:
            return self.connect_handler(ev)
        elif t == E.RDMA_CM_EVENT_ESTABLISHED:
            node.connected = True
            self.connects_left -= 1
            self.disconnects_left += 1
        elif t in (E.RDMA_CM_EVENT_ADDR_ERROR, E.RDMA_CM_EVENT_ROUTE_ERROR,
                   E.RDMA_CM_EVENT_CONNECT_ERROR, E.RDMA_CM_EVENT_UNREACHABLE,
                   E.RDMA_CM_EVENT_REJECTED):
            print(f"{NAME}: event: {event_str(t)}, error: {ev.status}")
            self.connects_left -= 1
            return ev.status
        elif t == E.RDMA_CM_EVENT_DISCONNECTED:
            try:
                node.cmid.disconnect()
            except PyverbsRDMAError:
                pass
            self.disconnects_left -= 1
        return 0

    def connect_handler(self, ev: Any) -> int:
        if self.conn_index == len(self.nodes):
            print(f"{NAME}: failing connection request")
            CMID(ev, listen_id=self.listen_id).reject()
            return -12  # -ENOMEM
        node = self.nodes[self.conn_index]
        self.conn_index += 1
        node.cmid = CMID(ev, listen_id=self.listen_id)
        self.by_id[id(node.cmid.id)] = node
        try:
            self.init_node(node)
            self.post_recvs(node)
            node.cmid.accept(None)
        except PyverbsRDMAError as e:
            print(f"{NAME}: failure accepting: {e}")
            self.connects_left -= 1
            print(f"{NAME}: failing connection request")
            try:
                node.cmid.reject()
            except PyverbsRDMAError:
                pass
            return -1
        return 0

    def next_event(self, what: str) -> Any:
        try:
            return self.channel.get_cm_event(STALL_TIMEOUT)
        except PyverbsRDMAError as e:
            raise ToolError(f"{NAME}: failure in rdma_get_cm_event in {what}: {e}") from None

    def connect_events(self) -> int:
        ret = 0
        while self.connects_left and not ret:
            ret = self.handler(self.next_event("connect events"))
        return ret

    def disconnect_events(self) -> int:
        ret = 0
        while self.disconnects_left and not ret:
            ret = self.handler(self.next_event("disconnect events"))
        return ret

    # ---- the two sides ------------------------------------------------------------------

    def run_server(self) -> int:
        print(f"{NAME}: starting server", flush=True)
        self.listen_id = CMID(self.channel, port_space=RDMA_PS_TCP)
        try:
            try:
                self.listen_id.bind_addr(AddrInfo(src=self.a.bind_addr,
                                                  src_service=self.a.port, flags=RAI_PASSIVE))
            except PyverbsRDMAError as e:
                print(f"{NAME}: bind address failed: {e}")
                return -1
            self.listen_id.listen(0)
            ret = self.connect_events()
            if ret:
                return ret
            if self.count:
                print("initiating data transfers", flush=True)
                for node in self.nodes:
                    self.post_sends(node)
                print("completing sends", flush=True)
                self.poll_cqs(0)
                print("receiving data transfers", flush=True)
                self.poll_cqs(1)
                print("data transfers complete", flush=True)
            print(f"{NAME}: disconnecting", flush=True)
            for node in self.nodes:
                if not node.connected:
                    continue
                node.connected = False
                node.cmid.disconnect()
            ret = self.disconnect_events()
            print("disconnected", flush=True)
            return ret
        finally:
            self.listen_id.close()

    def run_client(self) -> int:
        print(f"{NAME}: starting client", flush=True)
        print(f"{NAME}: connecting", flush=True)
        for node in self.nodes:
            try:
                node.cmid.resolve_addr(AddrInfo(src=self.a.bind_addr, dst=self.a.server_addr,
                                                dst_service=self.a.port), 2000)
            except PyverbsRDMAError as e:
                print(f"{NAME}: failure getting addr: {e}")
                return -1
        ret = self.connect_events()
        if not ret and self.count:
            print("receiving data transfers", flush=True)
            self.poll_cqs(1)
            print("sending replies", flush=True)
            for node in self.nodes:
                self.post_sends(node)
            print("data transfers complete", flush=True)
        ret2 = self.disconnect_events()
        return ret2 or ret

    def close(self) -> None:
        for node in self.nodes:
            node.destroy()
        self.channel.close()


def resolve_addrs(a: argparse.Namespace) -> None:
    """``rdma_getaddrinfo`` of -s and -b (names too, as getaddrinfo), and the device for
    the local address."""
    import socket
    for attr in ("server_addr", "bind_addr"):
        host = getattr(a, attr)
        if host:
            try:
                setattr(a, attr, socket.getaddrinfo(host, None, 0, socket.SOCK_STREAM)[0][4][0])
            except socket.gaierror as e:
                raise ToolError(f"rdma_getaddrinfo error: {e.strerror}") from None
    cm_device_for(a.bind_addr)


def run(a: argparse.Namespace) -> int:
    check_counts(a)
    resolve_addrs(a)
    test = Test(a)
    try:
        ret = test.run_client() if a.server_addr else test.run_server()
        print("test complete", flush=True)
    finally:
        test.close()
    print(f"return status {ret}", flush=True)
    return ret & 0xFF
