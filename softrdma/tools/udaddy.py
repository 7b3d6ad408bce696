"""``softrdma udaddy``: librdmacm's udaddy (librdmacm/examples/udaddy.c), on softrdma.

UD "connections" through rdma_cm on port space UDP, port 7174: the client resolves the
server with SIDR (``rdma_connect`` on a UDP id), the server answers with its QP number and
rdma_cm's Q_Key 0x01234567. Then, as udaddy does, so either side can be the unmodified
udaddy on a Linux rxe host:

* the client SENDs ``-C`` messages of ``-S`` bytes per connection, each a SEND with
  immediate whose immediate data is its own QP number (network order), to the QP number
  and Q_Key the SIDR reply gave, through the AH it gave;
* the server's receive buffers are ``-S`` + 40 bytes: on RoCE the first 40 hold the GRH
  area (RoCEv2 over IPv4: 20 zero bytes, then the packet's IPv4 header); from the first
  completion it builds the reply AH (``ibv_create_ah_from_wc``: the GRH's addresses
  swapped, hop limit 0xFF) and takes the immediate data as the remote QP number, then
  sends ``-C`` messages back.

Options as udaddy's: ``-s server``, ``-b bind address``, ``-c connections``, ``-C
message count``, ``-S message size``, ``-t tos``; ``-p`` is the port *space* as in udaddy
(0x111 UDP, the only one softrdma has); the port is always 7174 in udaddy, ``--port``
changes it here (a softrdma addition). Output lines and status as udaddy's.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..enums import IBV_ACCESS_LOCAL_WRITE, IBV_QPT_UD, IBV_SEND_SIGNALED, IBV_WR_SEND_WITH_IMM
from ..errors import PyverbsRDMAError
from ..rdmacm import (
    RAI_PASSIVE, RDMA_PS_UDP, RDMA_UDP_QKEY, AddrInfo, CMID, ConnParam, event_str,
)
from ..rdmacm.enums import rdma_cm_event_type as E
from . import cmatose
from .argtypes import c_int
from .common import ToolError, UsageError, add_fault_option

__all__ = ["add_parser", "run", "ah_attr_from_wc"]

NAME = "udaddy"
UDADDY_PORT = 7174
GRH_SIZE = 40


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "udaddy", help="librdmacm's udaddy: UD over rdma_cm (SIDR, port 7174)",
        description="udaddy, as librdmacm's: without -s a server, with -s a client; -c UD "
                    "'connections' resolved with SIDR, each exchanging -C SENDs with "
                    "immediate of -S bytes. Interoperates with udaddy on a Linux RDMA host.")
    cmatose.common_options(p, port="7174")
    p.add_argument("-p", dest="port_space", type=c_int, default=int(RDMA_PS_UDP),
                   metavar="port_space",
                   help=f"port space: {int(RDMA_PS_UDP):#x} for UDP (the default and the "
                        f"only one softrdma has)")
    p.add_argument("--port", dest="port", type=cmatose.port_arg, default=UDADDY_PORT,
                   help=f"the port number (udaddy always uses {UDADDY_PORT}; softrdma "
                        f"addition)")
    add_fault_option(p)
    p.set_defaults(func=run)


def ah_attr_from_wc(wc: Any, grh: bytes, gid_table: list[bytes], port_num: int = 1) -> Any:
    """The reply AH's attributes from a UD receive (``ibv_create_ah_from_wc``, as udaddy
    calls it): :func:`softrdma.verbs_api.ah.ah_attr_from_wc` with the tool's errors."""
    from ..verbs_api.ah import ah_attr_from_wc as from_wc
    try:
        return from_wc(wc, grh, gid_table, port_num)
    except PyverbsRDMAError as e:
        raise ToolError(f"udaddy: failed to create reply AH ({e})") from None


class Test(cmatose.Test):
    """``struct cmatest`` as udaddy.c uses it (UD, one CQ per node)."""

    PS = RDMA_PS_UDP

    def verify(self, node: Any) -> None:
        port = node.cmid.context.query_port(node.cmid.port_num)
        mtu = 128 << int(port.active_mtu)
        if self.count and self.size > mtu:
            print(f"{NAME}: message_size {self.size} is larger than active mtu {mtu}")
            raise PyverbsRDMAError("message size", 22)

    def init_node(self, node: Any) -> None:
        from ..verbs_api import CQ, MR, PD, QPCap, QPInitAttr
        ctx = node.cmid.context
        node.pd = PD(ctx)
        cqe = self.count * 2 if self.count else 2
        cq = CQ(ctx, cqe, None, None, 0)
        node.cqs = [cq]
        node.cmid.pd = node.pd
        wr = self.count or 1
        node.cmid.create_qp(QPInitAttr(qp_type=IBV_QPT_UD, scq=cq, rcq=cq, sq_sig_all=0,
                                       cap=QPCap(max_send_wr=wr, max_recv_wr=wr,
                                                 max_send_sge=1, max_recv_sge=1)))
        if self.count:
            node.mr = MR(node.pd, self.size + GRH_SIZE, IBV_ACCESS_LOCAL_WRITE)

    def post_recvs(self, node: Any) -> None:
        from ..verbs_api import SGE, RecvWR
        for _ in range(self.count):
            node.cmid.qp.post_recv(RecvWR(node.id, 1, [SGE(node.mr.buf, self.size + GRH_SIZE,
                                                           node.mr.lkey)]))

    def post_sends(self, node: Any, flags: int = 0) -> None:
        from ..verbs_api import SGE, SendWR
        if not node.connected or not self.count:
            return
        for _ in range(self.count):
            wr = SendWR(node.id, IBV_WR_SEND_WITH_IMM, 1,
                        sg=[SGE(node.mr.buf, self.size, node.mr.lkey)], send_flags=flags,
                        imm_data=node.cmid.qp.qp_num)  # htobe32(qp_num): the wire value
            wr.set_wr_ud(node.ah, node.remote_qpn, node.remote_qkey)
            node.cmid.qp.post_send(wr)

    def poll_cqs(self, index: int = 0) -> None:
        for node in self.nodes:
            if node.connected:
                cmatose.poll_cq(node.cqs[0], self.count,
                                lambda wcs, node=node: self.create_reply_ah(node, wcs[0]))

    def create_reply_ah(self, node: Any, wc: Any) -> None:
        from ..verbs_api import AH
        if node.ah is not None:
            return
        gids = [gid.raw for _, gid, _ in node.cmid.context.query_gid_table()]
        node.ah = AH(node.pd, attr=ah_attr_from_wc(wc, node.mr.read(GRH_SIZE, 0), gids))
        node.remote_qpn = wc.imm_data & 0xFFFFFF  # be32toh(imm_data)
        node.remote_qkey = RDMA_UDP_QKEY  # ibv_query_qp(IBV_QP_QKEY): rdma_cm's Q_Key

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
                self.verify(node)
                self.init_node(node)
                self.post_recvs(node)
                node.cmid.connect(ConnParam())
            except PyverbsRDMAError as e:
                if e.error_code != 22:
                    print(f"{NAME}: failure connecting: {e}")
                self.connects_left -= 1
                return -1
        elif t == E.RDMA_CM_EVENT_CONNECT_REQUEST:
            return self.connect_handler(ev)
        elif t == E.RDMA_CM_EVENT_ESTABLISHED:
            from ..verbs_api import AH
            ud = ev.param
            node.remote_qpn, node.remote_qkey = ud.qp_num, ud.qkey
            try:
                node.ah = AH(node.pd, attr=ud.ah_attr)
            except PyverbsRDMAError:
                print(f"{NAME}: failure creating address handle")
                self.connects_left -= 1
                return -1
            node.connected = True
            self.connects_left -= 1
        elif t in (E.RDMA_CM_EVENT_ADDR_ERROR, E.RDMA_CM_EVENT_ROUTE_ERROR,
                   E.RDMA_CM_EVENT_CONNECT_ERROR, E.RDMA_CM_EVENT_UNREACHABLE,
                   E.RDMA_CM_EVENT_REJECTED):
            print(f"{NAME}: event: {event_str(t)}, error: {ev.status}")
            self.connects_left -= 1
            return ev.status
        return 0

    def connect_handler(self, ev: Any) -> int:
        if self.conn_index == len(self.nodes):
            print(f"{NAME}: failing connection request")
            CMID(ev, listen_id=self.listen_id).reject()
            return -12
        node = self.nodes[self.conn_index]
        self.conn_index += 1
        node.cmid = CMID(ev, listen_id=self.listen_id)
        self.by_id[id(node.cmid.id)] = node
        try:
            self.verify(node)
            self.init_node(node)
            self.post_recvs(node)
            node.cmid.accept(ConnParam(qp_num=node.cmid.qp.qp_num))
        except PyverbsRDMAError as e:
            if e.error_code != 22:
                print(f"{NAME}: failure accepting: {e}")
            self.connects_left -= 1
            print(f"{NAME}: failing connection request")
            try:
                node.cmid.reject()
            except PyverbsRDMAError:
                pass
            node.cmid.close()
            node.cmid = None
            return -1
        node.connected = True
        self.connects_left -= 1
        return 0

    def run_server(self) -> int:
        print(f"{NAME}: starting server", flush=True)
        self.listen_id = CMID(self.channel, port_space=RDMA_PS_UDP)
        try:
            try:
                self.listen_id.bind_addr(AddrInfo(src=self.a.bind_addr, port_space=RDMA_PS_UDP,
                                                  src_service=self.a.port, flags=RAI_PASSIVE))
            except PyverbsRDMAError as e:
                print(f"{NAME}: bind address failed: {e}")
                return -1
            self.listen_id.listen(0)
            self.connect_events()  # udaddy ignores its result
            if self.count:
                print("receiving data transfers", flush=True)
                self.poll_cqs()
                print("sending replies", flush=True)
                for node in self.nodes:
                    self.post_sends(node, IBV_SEND_SIGNALED)
                self.poll_cqs()
                print("data transfers complete", flush=True)
            return 0
        finally:
            self.listen_id.close()

    def run_client(self) -> int:
        print(f"{NAME}: starting client", flush=True)
        print(f"{NAME}: connecting", flush=True)
        for node in self.nodes:
            try:
                node.cmid.resolve_addr(AddrInfo(src=self.a.bind_addr, dst=self.a.server_addr,
                                                port_space=RDMA_PS_UDP,
                                                dst_service=self.a.port), 2000)
            except PyverbsRDMAError as e:
                print(f"{NAME}: failure getting addr: {e}")
                return -1
        ret = self.connect_events()
        if ret:
            return ret
        if self.count:
            print("initiating data transfers", flush=True)
            for node in self.nodes:
                self.post_sends(node, 0)
            print("receiving data transfers", flush=True)
            self.poll_cqs()
            print("data transfers complete", flush=True)
        return 0


def run(a: argparse.Namespace) -> int:
    if a.port_space != RDMA_PS_UDP:
        raise UsageError(f"argument -p: port space {a.port_space:#x} is not supported "
                         f"(softrdma has {int(RDMA_PS_UDP):#x}, UDP)")
    cmatose.check_counts(a)
    cmatose.resolve_addrs(a)
    test = Test(a)
    try:
        ret = test.run_client() if a.server_addr else test.run_server()
        print("test complete", flush=True)
    finally:
        test.close()
    print(f"return status {ret}", flush=True)
    return ret & 0xFF
