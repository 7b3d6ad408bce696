"""``softrdma pingpong {rc,uc,ud,srq}``: rdma-core's ibv_*_pingpong, in softrdma.

Same options, same out-of-band exchange on TCP (default port 18515), same output lines, so
either side can be the unmodified rdma-core tool on a Linux rxe host:

- each side sends ``"%04x:%06x:%06x:%s\\0"`` (LID, QPN, PSN, GID as 32 hex digits), 52
  bytes; the client first, the server answers after moving its QP to RTS, the client ends
  with ``"done\\0"``. ibv_srq_pingpong sends 256 such records each way (unused ones zero).
- one buffer per side is received into and sent from (UD: receives get 40 bytes of GRH
  first); the client sends first; each side sends again once its previous send completed
  and a receive arrived; ``iters`` each way.

Options are checked as rdma-core checks them, numbers read as ``strtol(optarg, NULL, 0)``
reads them: a usage error (one line, exit status 2; rdma-core prints its usage and exits 1)
for ``-p`` outside 1..65535, ``-i`` below 1, ``-m`` other than 256/512/1024/2048/4096, srq's
``-s`` below 1, and for what rdma-core reads as unsigned and softrdma refuses rather than
wraps (a negative or non-numeric ``-s``, ``-r``, ``-n``, ``-q``; ``-r``, ``-n`` and ``-q``
of 0; ``-l`` above 15). Then, with rdma-core's messages and status 1: srq's "rx_depth N is
too small for M QPs" and "num_qp N must be less than 255", and before any connection
"can't read sgid of index N" (an empty GID entry too), ud's "Requested size larger than
port MTU", a size above the port's max_msg_sz, an rx depth above the device's max_qp_wr.
"""

from __future__ import annotations

import argparse
import random
import socket
import time
from typing import Any

from ..readiness import readable
from ..enums import (
    IBV_ACCESS_LOCAL_WRITE, IBV_QP_STATE, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPT_RC, IBV_QPT_UC,
    IBV_QPT_UD, IBV_SEND_INLINE, IBV_SEND_SIGNALED, IBV_WR_SEND, bytes_to_mtu, wc_status_str,
)
from ..errors import PyverbsRDMAError
from ..verbs_api import (
    AH, CQ, MR, PD, QP, SGE, SRQ, AHAttr, CompChannel, Context, GlobalRoute, QPAttr, QPCap,
    QPInitAttr, RecvWR, SendWR, SrqAttr, SrqInitAttr,
)
from .argtypes import c_int, choice_int, int_range, ip_address
from .common import (
    DEVICE_HELP, add_fault_option,
    ToolError, UsageError, open_device, recv_exact, resolve, tcp_connect, tcp_listen,
)

__all__ = ["add_parser", "run"]

RECV_WRID = 1
SEND_WRID = 2
UD_QKEY = 0x11111111
MSG_SIZE = 52
SRQ_MAX_QP = 256
GRH = 40
UINT_MAX = 0xFFFFFFFF
MTUS = (256, 512, 1024, 2048, 4096)  # pingpong.c's pp_mtu_to_enum


def encode_dest(lid: int, qpn: int, psn: int, gid: bytes) -> bytes:
    msg = f"{lid:04x}:{qpn:06x}:{psn:06x}:{gid.hex()}".encode()
    return msg + b"\0" * (MSG_SIZE - len(msg))


def parse_dest(msg: bytes) -> tuple[int, int, int, bytes]:
    text = msg.split(b"\0", 1)[0].decode("ascii", "replace")
    try:
        lid, qpn, psn, gid = text.split(":", 3)
        return int(lid, 16), int(qpn, 16), int(psn, 16), bytes.fromhex(gid[:32].ljust(32, "0"))
    except ValueError:
        raise ToolError(f"Couldn't parse the peer's address {text!r}: not an rdma-core pingpong "
                        f"message") from None


def gid_str(gid: bytes) -> str:
    """As the C tools print it: inet_ntop(AF_INET6), e.g. ``::ffff:10.77.0.12``."""
    return socket.inet_ntop(socket.AF_INET6, gid)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("pingpong", help="rdma-core's ibv_{rc,uc,ud,srq}_pingpong",
                       description="Ping-pong between two hosts, compatible with rdma-core's "
                                   "ibv_rc_pingpong, ibv_uc_pingpong, ibv_ud_pingpong and "
                                   "ibv_srq_pingpong. Without SERVER, wait for a client.")
    p.add_argument("kind", choices=["rc", "uc", "ud", "srq"])
    p.add_argument("servername", nargs="?", help="connect to this server (else: be the server)")
    # What rdma-core refuses while parsing (usage, exit status 1 there, 2 here like any usage
    # error): -p above 65535, -i below 1, -m not a valid MTU, srq's -s below 1. The other
    # numbers are unsigned there (strtoul); a negative or non-numeric one is refused here
    # rather than wrapped or read as 0.
    p.add_argument("-p", "--port", type=int_range(1, 65535), default=18515,
                   help="listen on/connect to port (18515)")
    p.add_argument("-d", "--ib-dev", metavar="NAME", help=DEVICE_HELP)
    p.add_argument("-a", "--addr", type=ip_address, help="local IP address for the soft device")
    p.add_argument("-i", "--ib-port", type=int_range(1, None), default=1,
                   help="port of the device (1)")
    p.add_argument("-s", "--size", type=int_range(0, UINT_MAX),
                   help="message size (4096; ud: 1024; srq: at least 1)")
    p.add_argument("-m", "--mtu", type=choice_int(MTUS), default=1024,
                   help="path MTU: 256, 512, 1024, 2048 or 4096 (1024)")
    p.add_argument("-r", "--rx-depth", type=int_range(1, UINT_MAX),
                   help="receives to post at a time (500)")
    p.add_argument("-n", "--iters", type=int_range(1, UINT_MAX), default=1000,
                   help="exchanges (1000)")
    p.add_argument("-l", "--sl", type=int_range(0, 15), default=0, help="service level 0..15 (0)")
    p.add_argument("-e", "--events", action="store_true", help="sleep on CQ events")
    p.add_argument("-g", "--gid-idx", type=c_int, default=1,
                   help="local GID index, as softrdma devinfo -v lists the device's GIDs (1: "
                        "the IPv4/IPv6 address, 0: the link-local one; negative: none; "
                        "rdma-core's default is none)")
    p.add_argument("-c", "--chk", action="store_true", help="validate the received buffer")
    p.add_argument("-q", "--num-qp", type=int_range(1, UINT_MAX), default=16,
                   help=f"srq: number of QPs, less than {SRQ_MAX_QP} (16)")
    p.add_argument("--counters", action="store_true",
                   help="print the device's counters at the end (softrdma addition)")
    add_fault_option(p)
    p.set_defaults(func=run)


class _Side:
    """The verbs resources of one pingpong endpoint."""

    def __init__(self, a: argparse.Namespace, dev: Any) -> None:
        self.a = a
        self.kind = a.kind
        self.ctx = Context(name=dev.name)
        self.dev = dev
        self.size = a.size
        self.num_qp = a.num_qp if a.kind == "srq" else 1
        bufsize = self.size + (GRH if a.kind == "ud" else 0)
        self.pd = PD(self.ctx)
        self.mr = MR(self.pd, max(bufsize, 1), IBV_ACCESS_LOCAL_WRITE)
        self.channel = CompChannel(self.ctx) if a.events else None
        self.cq = CQ(self.ctx, a.rx_depth + self.num_qp, None, self.channel, 0)
        self.srq = None
        qpt = {"rc": IBV_QPT_RC, "uc": IBV_QPT_UC, "ud": IBV_QPT_UD, "srq": IBV_QPT_RC}[a.kind]
        if a.kind == "srq":
            self.srq = SRQ(self.pd, SrqInitAttr(SrqAttr(max_wr=a.rx_depth, max_sge=1)))
        cap = QPCap(max_send_wr=1, max_recv_wr=a.rx_depth, max_send_sge=1, max_recv_sge=1)
        self.qps = []
        for _ in range(self.num_qp):
            qp = QP(self.pd, QPInitAttr(qp_type=qpt, scq=self.cq, rcq=self.cq, srq=self.srq,
                                        cap=QPCap(**cap.__dict__)))
            attr = QPAttr(pkey_index=0, port_num=a.ib_port, qp_access_flags=0, qkey=UD_QKEY)
            qp.to_init(attr)
            self.qps.append(qp)
        self.send_flags = IBV_SEND_SIGNALED
        if self.qps[0].cap.max_inline_data >= self.size:
            self.send_flags |= IBV_SEND_INLINE
        # initial PSNs: rdma-core seeds lrand48 with getpid() * time(NULL), which anyone
        # who knows roughly when the tool started can reproduce; ours come from the OS
        self.rng = random.SystemRandom()
        self.psns = [self.rng.getrandbits(24) for _ in self.qps]
        self.gid = self.ctx.query_gid(a.ib_port, a.gid_idx).raw if a.gid_idx >= 0 else bytes(16)
        self.ah = None

    def dests(self) -> list[bytes]:
        return [encode_dest(0, qp.qp_num, psn, self.gid) for qp, psn in zip(self.qps, self.psns)]

    def post_recv(self, n: int) -> int:
        length = self.size + (GRH if self.kind == "ud" else 0)
        sge = SGE(self.mr.buf, length, self.mr.lkey)
        target = self.srq if self.srq is not None else self.qps[0]
        for i in range(n):
            try:
                target.post_recv(RecvWR(RECV_WRID, sg=[sge]))
            except PyverbsRDMAError:
                return i
        return n

    def connect(self, i: int, rem: tuple[int, int, int, bytes]) -> None:
        a = self.a
        qp = self.qps[i]
        _lid, rqpn, rpsn, rgid = rem
        gr = GlobalRoute(dgid=rgid, sgid_index=a.gid_idx, hop_limit=1) if rgid[8:] != bytes(8) else None
        ah_attr = AHAttr(dlid=0, sl=a.sl, port_num=a.ib_port, is_global=1 if gr else 0, gr=gr)
        if self.kind == "ud":
            qp.modify(QPAttr(qp_state=IBV_QPS_RTR), IBV_QP_STATE)
            at = QPAttr(qp_state=IBV_QPS_RTS, sq_psn=self.psns[i])
            qp.modify(at, IBV_QP_STATE | (1 << 16))
            ah_attr.gr = GlobalRoute(dgid=rgid, sgid_index=a.gid_idx, hop_limit=1) if gr else None
            self.ah = AH(self.pd, attr=ah_attr)
            self.rem_qpn = rqpn
            return
        at = QPAttr(port_num=a.ib_port)
        at.path_mtu = bytes_to_mtu(a.mtu)
        at.dest_qp_num, at.rq_psn = rqpn, rpsn
        at.max_dest_rd_atomic, at.min_rnr_timer = 1, 12
        at.ah_attr = ah_attr
        at.sq_psn, at.timeout, at.retry_cnt, at.rnr_retry, at.max_rd_atomic = \
            self.psns[i], 14, 7, 7, 1
        if self.kind == "uc":
            qp.modify(_with_state(at, IBV_QPS_RTR), IBV_QP_STATE | (1 << 7) | (1 << 8) | (1 << 20)
                      | (1 << 12))
            qp.modify(_with_state(at, IBV_QPS_RTS), IBV_QP_STATE | (1 << 16))
        else:
            qp.to_rtr(at)
            qp.to_rts(at)

    def post_send(self, i: int) -> None:
        if self.kind == "ud":
            wr = SendWR(SEND_WRID, opcode=IBV_WR_SEND,
                        sg=[SGE(self.mr.buf + GRH, self.size, self.mr.lkey)],
                        send_flags=self.send_flags)
            wr.set_wr_ud(self.ah, self.rem_qpn, UD_QKEY)
        else:
            wr = SendWR(SEND_WRID, opcode=IBV_WR_SEND, sg=[SGE(self.mr.buf, self.size, self.mr.lkey)],
                        send_flags=self.send_flags)
        self.qps[i].post_send(wr)

    def wait(self) -> list[Any]:
        """Completions, waiting (and making progress on the device) until there are some."""
        while True:
            n, wcs = self.cq.poll(16)
            if n:
                return wcs
            if self.channel is not None:
                self.cq.req_notify()
                n, wcs = self.cq.poll(16)
                if n:
                    return wcs
                while not readable([self.channel.fd], 0):
                    self.dev.poll(0.05)
                self.channel.get_cq_event(self.cq)
                self.cq.ack_events(1)
            else:
                self.dev.poll(0.05)

    def close(self) -> None:
        self.ctx.close()


def _with_state(at: QPAttr, st: int) -> QPAttr:
    at.qp_state = st
    return at


def run(a: argparse.Namespace) -> int:
    if a.size is None:
        a.size = 1024 if a.kind == "ud" else 4096
    if a.rx_depth is None:
        a.rx_depth = 500
    _check(a)
    server = a.servername is None
    peer = resolve(a.servername) if a.servername else None
    dev = open_device(a.ib_dev, a.addr, peer=peer, mtu=None)
    try:
        _check_device(a, dev)
        side = _Side(a, dev)
    except BaseException:
        dev.detach()
        raise
    try:
        rc = _pingpong(a, side, server, peer)
        if a.counters:
            for k, v in dev.counters.as_dict().items():
                print(f"{k}: {v}")
        return rc
    finally:
        side.close()
        dev.detach()


def _check(a: argparse.Namespace) -> None:
    """The checks rdma-core makes after parsing (exit status 1, its messages)."""
    if a.kind == "srq":
        if a.size < 1:  # srq_pingpong.c refuses it while parsing: a usage error
            raise UsageError(f"argument -s/--size: {a.size} is not positive (srq)")
        if a.num_qp > a.rx_depth:
            raise ToolError(f"rx_depth {a.rx_depth} is too small for {a.num_qp} QPs -- must have "
                            f"at least one receive per QP.")
        if a.num_qp >= SRQ_MAX_QP:
            raise ToolError(f"num_qp {a.num_qp} must be less than {SRQ_MAX_QP - 1}")


def _check_device(a: argparse.Namespace, dev: Any) -> None:
    """What rdma-core finds out from the device before it connects: GID, sizes."""
    if a.gid_idx >= 0:
        # ibv_query_gid fails beyond the table (rdma-core: "can't read sgid of index N"); an
        # empty entry reads as zeros there and fails at RTR, after the exchange: refuse it now
        if a.gid_idx >= dev.limits.gid_tbl_len or a.gid_idx >= len(dev.gid_table) or \
                not any(dev.gid_table[a.gid_idx]):
            raise ToolError(f"can't read sgid of index {a.gid_idx}")
    mtu = 128 << int(dev.active_mtu)
    if a.kind == "ud" and a.size > mtu:
        raise ToolError(f"Requested size larger than port MTU ({mtu})")
    if a.size > dev.limits.max_msg_sz:  # post_send would refuse it: say so before allocating
        raise ToolError(f"Requested size larger than port max_msg_sz ({dev.limits.max_msg_sz})")
    if a.rx_depth > dev.limits.max_qp_wr:  # ibv_create_qp/ibv_create_srq would fail
        raise ToolError(f"Couldn't create QP (rx_depth {a.rx_depth} is above the device's "
                        f"max_qp_wr {dev.limits.max_qp_wr})")


def _pingpong(a: argparse.Namespace, side: _Side, server: bool, peer: str | None) -> int:
    routs = side.post_recv(a.rx_depth)
    if routs < a.rx_depth:
        raise ToolError(f"Couldn't post receive ({routs})")
    mine = side.dests()
    for i, qp in enumerate(side.qps):
        print(f"  local address:  LID 0x0000, QPN 0x{qp.qp_num:06x}, PSN 0x{side.psns[i]:06x}, "
              f"GID {gid_str(side.gid)}")
    nrec = SRQ_MAX_QP if a.kind == "srq" else 1
    mine = mine + [encode_dest(0, 0, 0, bytes(16))] * (nrec - len(mine))
    if server:
        ls = tcp_listen(side.dev.ip, a.port)
        conn, _ = ls.accept()
        ls.close()
        with conn:
            rem = [parse_dest(recv_exact(conn, MSG_SIZE)) for _ in range(nrec)]
            for i in range(side.num_qp):
                side.connect(i, rem[i])
            conn.sendall(b"".join(mine))
            recv_exact(conn, 5)  # "done"
    else:
        conn = tcp_connect(peer, a.port)
        with conn:
            conn.sendall(b"".join(mine))
            rem = [parse_dest(recv_exact(conn, MSG_SIZE)) for _ in range(nrec)]
            conn.sendall(b"done\0")
        for i in range(side.num_qp):
            side.connect(i, rem[i])
    for i in range(side.num_qp):
        _l, rq, rp, rg = rem[i]
        print(f"  remote address: LID 0x0000, QPN 0x{rq:06x}, PSN 0x{rp:06x}, GID {gid_str(rg)}")

    if a.chk and not server:
        pattern = bytes((i * 7 + 3) & 0xFF for i in range(a.size))
        side.mr.write(pattern, a.size, GRH if a.kind == "ud" else 0)
    pending = [RECV_WRID] * side.num_qp
    scnt = rcnt = 0
    qp_index = {qp.qp_num: i for i, qp in enumerate(side.qps)}
    start = time.monotonic()
    if not server:
        for i in range(side.num_qp):
            side.post_send(i)
            pending[i] |= SEND_WRID
    iters = a.iters
    while rcnt < iters or scnt < iters:
        for wc in side.wait():
            if wc.status != 0:
                raise ToolError(f"Failed status {wc_status_str(wc.status)} ({wc.status}) for "
                                f"wr_id {wc.wr_id}")
            qi = qp_index.get(wc.qp_num, 0)
            if wc.wr_id == SEND_WRID:
                scnt += 1
            elif wc.wr_id == RECV_WRID:
                routs -= 1
                if routs <= side.num_qp:
                    routs += side.post_recv(a.rx_depth - routs)
                rcnt += 1
                if a.chk:
                    off = GRH if a.kind == "ud" else 0
                    exp = bytes((i * 7 + 3) & 0xFF for i in range(a.size))
                    got = side.mr.read(a.size, off)
                    if got != exp:
                        bad = next(i for i in range(a.size) if got[i] != exp[i])
                        print(f"Invalid data in page {bad // 4096}")
            else:
                raise ToolError(f"Completion for unknown wr_id {wc.wr_id}")
            pending[qi] &= ~wc.wr_id
            if scnt < iters and not pending[qi]:
                side.post_send(qi)
                pending[qi] = RECV_WRID | SEND_WRID
    usec = max((time.monotonic() - start) * 1e6, 1.0)
    nbytes = a.size * iters * 2
    print(f"{nbytes} bytes in {usec / 1e6:.2f} seconds = {nbytes * 8.0 / usec:.2f} Mbit/sec")
    print(f"{iters} iters in {usec / 1e6:.2f} seconds = {usec / iters:.2f} usec/iter")
    return 0
