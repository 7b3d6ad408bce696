"""``softrdma mckey``: librdmacm's mckey (librdmacm/examples/mckey.c), on softrdma.

UD multicast through rdma_cm: each of ``-c`` ids resolves the group's address (``-m``),
makes a UD QP, and joins the group (``rdma_join_multicast_ex``, full member, or send-only
with ``-o``). RDMA_CM_EVENT_MULTICAST_JOIN gives the UD parameters that reach the group
(QPN 0xFFFFFF, rdma_cm's Q_Key 0x01234567, an AH to the group's GID ``::ffff:a.b.c.d``),
and the join attaches the QP. After 3 seconds (mckey's pause "to give SM chance to
configure switches") a sender (``-s``) posts ``-C`` SENDs with immediate of ``-S`` bytes
to the group, unsignaled, each carrying its QP number as the immediate data; a receiver
(no ``-s``) has posted ``-C`` receives of ``-S`` + 40 bytes (the GRH area) before joining
and waits for ``-C`` completions. Both leave the group, and print what mckey prints, so
either side can be the unmodified mckey on a Linux rxe host.

Options as mckey's: ``-m`` group address, ``-M`` unmapped (AF_IB) address (needs ``-b``;
on RoCEv2 the kernel refuses it, ENOTSUPP), ``-s`` sender, ``-b`` bind address, ``-c``
connections, ``-C`` message count, ``-S`` message size, ``-p`` port space (0x111 UDP,
0x2 IPoIB), ``-o`` send-only join, ``-l`` no multicast loopback (a create flag rxe
refuses: EOPNOTSUPP). A softrdma addition: ``--timeout`` bounds a receiver's wait (mckey
waits for ever), ``--pause`` changes the 3 seconds.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import time
from typing import Any

from ..enums import IBV_ACCESS_LOCAL_WRITE, IBV_QPT_UD, IBV_WR_SEND_WITH_IMM
from ..errors import PyverbsRDMAError
from ..rdmacm import RAI_PASSIVE, RDMA_PS_UDP, AddrInfo, CMEventChannel, CMID, event_str
from ..rdmacm.enums import RDMA_PS_IPOIB, rdma_cm_event_type as E
from .argtypes import c_int
from .common import ToolError, UsageError, add_fault_option, cm_device_for

__all__ = ["add_parser", "run"]

NAME = "mckey"
GRH_SIZE = 40
SENDONLY = 1  # RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER
ENOTSUPP = 524  # the kernel's answer to an AF_IB group on RoCEv2


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "mckey", help="librdmacm's mckey: UD multicast over rdma_cm (join, send to the group)",
        description="mckey, as librdmacm's: join the multicast group -m (or -M), then as a "
                    "sender (-s) send -C messages of -S bytes to it, or as a receiver wait "
                    "for -C of them. Interoperates with mckey on a Linux RDMA host.")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("-m", dest="mcast", metavar="multicast_address",
                   help="the multicast group's address (IPv4 239.x.y.z, ...)")
    g.add_argument("-M", dest="unmapped", metavar="unmapped_multicast_address",
                   help="an unmapped (AF_IB) multicast address; requires -b")
    p.add_argument("-s", dest="sender", action="store_true", help="be the sender")
    p.add_argument("-b", dest="bind_addr", metavar="bind_address",
                   help="the local address to bind to")
    p.add_argument("-c", dest="connections", type=_atoi, default=1, metavar="connections",
                   help="number of ids joining (1)")
    p.add_argument("-C", dest="message_count", type=_atoi, default=10,
                   metavar="message_count", help="messages per id (10)")
    p.add_argument("-S", dest="message_size", type=_atoi, default=100,
                   metavar="message_size", help="message size in bytes (100)")
    p.add_argument("-p", dest="port_space", type=c_int, default=int(RDMA_PS_UDP),
                   metavar="port_space", help=f"{int(RDMA_PS_UDP):#x} for UDP (default), "
                                              f"{int(RDMA_PS_IPOIB):#x} for IPOIB")
    p.add_argument("-o", dest="send_only", action="store_true",
                   help="join as a send-only full member")
    p.add_argument("-l", dest="no_loopback", action="store_true",
                   help="join without multicast loopback")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="a receiver gives up after this long (softrdma addition; mckey "
                        "waits for ever)")
    p.add_argument("--pause", type=float, default=3.0, metavar="SECONDS",
                   help="the pause after joining, before sending (mckey's 3 s)")
    add_fault_option(p)
    p.set_defaults(func=run)


def _atoi(text: str) -> int:
    """An argparse ``type``: a decimal integer, as mckey's atoi (but refusing junk)."""
    try:
        return int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer: {text!r}") from None


class Node:
    """``struct cmatest_node``: one id, its verbs resources and the group's UD address."""

    def __init__(self, i: int, cmid: CMID) -> None:
        self.id = i
        self.cmid = cmid
        self.connected = False
        self.pd = self.cq = self.mr = self.ah = None
        self.remote_qpn = self.remote_qkey = 0

    def destroy(self) -> None:
        for obj in (self.ah, self.cmid, self.cq, self.mr, self.pd):
            if obj is not None:
                try:
                    obj.close()
                except PyverbsRDMAError:
                    pass


class Mckey:
    """``struct cmatest`` and what mckey.c does with it."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.count = a.message_count if a.message_size else 0
        self.size = a.message_size
        self.channel = CMEventChannel()
        self.nodes = [Node(i, CMID(self.channel, port_space=a.port_space))
                      for i in range(a.connections)]
        self.by_id = {id(n.cmid.id): n for n in self.nodes}
        self.connects_left = a.connections
        self.group = a.mcast or a.unmapped

    # ---- the verbs resources (init_node, post_recvs, post_sends) ---------------------------
    def verify(self, node: Node) -> None:
        port = node.cmid.context.query_port(node.cmid.port_num)
        mtu = 128 << int(port.active_mtu)
        if self.count and self.size > mtu:
            print(f"{NAME}: message_size {self.size} is larger than active mtu {mtu}")
            raise PyverbsRDMAError("message size", errno.EINVAL)

    def init_node(self, node: Node) -> None:
        from ..verbs_api import CQ, MR, PD, QPCap, QPInitAttr
        ctx = node.cmid.context
        node.pd = PD(ctx)
        node.cq = CQ(ctx, self.count * 2 if self.count else 2, None, None, 0)
        node.cmid.pd = node.pd
        if self.a.no_loopback:
            # IBV_QP_CREATE_BLOCK_SELF_MCAST_LB: rxe's create_qp refuses create flags
            print(f"{NAME}: unable to create QP: {os.strerror(errno.EOPNOTSUPP)}")
            raise PyverbsRDMAError("create flags", errno.EOPNOTSUPP)
        wr = self.count or 1
        try:
            node.cmid.create_qp(QPInitAttr(qp_type=IBV_QPT_UD, scq=node.cq, rcq=node.cq,
                                           sq_sig_all=0, cap=QPCap(max_send_wr=wr,
                                                                   max_recv_wr=wr,
                                                                   max_send_sge=1,
                                                                   max_recv_sge=1)))
        except PyverbsRDMAError as e:
            print(f"{NAME}: unable to create QP: {os.strerror(e.error_code)}")
            raise
        if self.count:
            node.mr = MR(node.pd, self.size + GRH_SIZE, IBV_ACCESS_LOCAL_WRITE)

    def post_recvs(self, node: Node) -> None:
        from ..verbs_api import SGE, RecvWR
        for _ in range(self.count):
            node.cmid.qp.post_recv(RecvWR(node.id, 1, [SGE(node.mr.buf, self.size + GRH_SIZE,
                                                           node.mr.lkey)]))

    def post_sends(self, node: Node) -> None:
        from ..verbs_api import SGE, SendWR
        if not node.connected or not self.count:
            return
        for _ in range(self.count):
            wr = SendWR(node.id, IBV_WR_SEND_WITH_IMM, 1,
                        sg=[SGE(node.mr.buf, self.size, node.mr.lkey)], send_flags=0,
                        imm_data=node.cmid.qp.qp_num)  # htobe32(qp_num): the wire value
            wr.set_wr_ud(node.ah, node.remote_qpn, node.remote_qkey)
            node.cmid.qp.post_send(wr)

    # ---- events ---------------------------------------------------------------------------
    def addr_handler(self, node: Node) -> int:
        try:
            self.verify(node)
            self.init_node(node)  # prints its own failures
            if not self.a.sender:
                self.post_recvs(node)
        except PyverbsRDMAError:
            self.connects_left -= 1
            return -1
        try:
            if self.a.unmapped:  # an AF_IB group: cma_iboe_join_multicast has none on RoCEv2
                raise PyverbsRDMAError("rdma_join_multicast_ex: AF_IB group", ENOTSUPP)
            node.cmid.join_multicast(self.group, context=node,
                                     join_flags=SENDONLY if self.a.send_only else 0)
        except PyverbsRDMAError as e:
            print(f"{NAME}: failure joining: {os.strerror(e.error_code)}")
            self.connects_left -= 1
            return -1
        return 0

    def join_handler(self, node: Node, ud: Any) -> int:
        from ..verbs_api import AH
        dgid = socket.inet_ntop(socket.AF_INET6, bytes(ud.ah_attr.gr.dgid.raw))  # as mckey
        print(f"{NAME}: joined dgid: {dgid} mlid 0x{ud.ah_attr.dlid:x} sl {ud.ah_attr.sl}",
              flush=True)
        node.remote_qpn, node.remote_qkey = ud.qp_num, ud.qkey
        try:
            node.ah = AH(node.pd, attr=ud.ah_attr)
        except PyverbsRDMAError:
            print(f"{NAME}: failure creating address handle")
            self.connects_left -= 1
            return -1
        node.connected = True
        self.connects_left -= 1
        return 0

    def handler(self, ev: Any) -> int:
        t = ev.event_type
        node = self.by_id.get(id(ev.id))
        if t == E.RDMA_CM_EVENT_ADDR_RESOLVED:
            return self.addr_handler(node)
        if t == E.RDMA_CM_EVENT_MULTICAST_JOIN:
            return self.join_handler(node, ev.param)
        if t in (E.RDMA_CM_EVENT_ADDR_ERROR, E.RDMA_CM_EVENT_ROUTE_ERROR,
                 E.RDMA_CM_EVENT_MULTICAST_ERROR):
            print(f"{NAME}: event: {event_str(t)}, error: {ev.status}")
            self.connects_left -= 1
            return ev.status
        return 0

    def connect_events(self) -> int:
        ret = 0
        while self.connects_left and not ret:
            try:
                ev = self.channel.get_cm_event(60.0)
            except PyverbsRDMAError as e:
                raise ToolError(f"rdma_get_cm_event: {e}") from None
            ret = self.handler(ev)
        return ret

    def poll_cqs(self) -> int:
        """``-C`` completions per joined id, as mckey waits for them; with ``--timeout``,
        what arrived by then is said ("N of C messages received") and the run fails."""
        deadline = None if self.a.timeout is None else time.monotonic() + self.a.timeout
        for node in self.nodes:
            if not node.connected:
                continue
            done = 0
            while done < self.count:
                n, _ = node.cq.poll(8)
                done += n
                if not n:
                    if deadline is not None and time.monotonic() > deadline:
                        print(f"{NAME}: {done} of {self.count} messages received in "
                              f"{self.a.timeout:g} s", flush=True)
                        return -errno.ETIMEDOUT
                    time.sleep(0.0005)
        return 0

    # ---- the run --------------------------------------------------------------------------
    def run(self) -> int:
        a = self.a
        print(f"{NAME}: starting {'client' if a.sender else 'server'}", flush=True)
        print(f"{NAME}: joining", flush=True)
        for node in self.nodes:
            try:
                if a.bind_addr:
                    node.cmid.bind_addr(AddrInfo(src=a.bind_addr, port_space=RDMA_PS_UDP,
                                                 flags=RAI_PASSIVE))
                if a.unmapped:
                    ret = self.addr_handler(node)
                    if ret:
                        return ret
                    continue
                node.cmid.resolve_addr(AddrInfo(src=a.bind_addr, dst=a.mcast,
                                                port_space=RDMA_PS_UDP), 2000)
            except PyverbsRDMAError as e:
                print(f"{NAME}: resolve addr failure: {os.strerror(e.error_code)}")
                self.connects_left -= 1
                return -1
        ret = self.connect_events()
        if not ret:
            time.sleep(a.pause)
            if self.count:
                if a.sender:
                    print("initiating data transfers", flush=True)
                    for node in self.nodes:
                        self.post_sends(node)
                else:
                    print("receiving data transfers", flush=True)
                    ret = self.poll_cqs()
                if not ret:
                    print("data transfers complete", flush=True)
        for node in self.nodes:
            try:
                node.cmid.leave_multicast(self.group)
            except PyverbsRDMAError as e:
                print(f"{NAME}: failure leaving: {os.strerror(e.error_code)}")
                ret = -1
        return ret

    def close(self) -> None:
        for node in self.nodes:
            node.destroy()
        self.channel.close()


def run(a: argparse.Namespace) -> int:
    if a.unmapped and not a.bind_addr:
        print("unmapped multicast address requires binding to source address")
        return 1
    if a.port_space not in (RDMA_PS_UDP, RDMA_PS_IPOIB):
        raise UsageError(f"argument -p: port space {a.port_space:#x} is not supported "
                         f"({int(RDMA_PS_UDP):#x} UDP, {int(RDMA_PS_IPOIB):#x} IPOIB)")
    if a.connections < 1 or a.message_count < 0 or a.message_size < 0:
        raise UsageError("arguments -c, -C, -S: out of range")
    cm_device_for(a.bind_addr)
    test = Mckey(a)
    try:
        ret = test.run()
        print("test complete", flush=True)
    finally:
        test.close()
    print(f"return status {ret}", flush=True)
    return ret & 0xFF
