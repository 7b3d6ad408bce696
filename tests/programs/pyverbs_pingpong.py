#!/usr/bin/env python3
"""An RC ping-pong written against pyverbs (rdma-core's Python binding) and nothing else.

    pyverbs_pingpong.py loopback [-n ITERS] [-g GID_INDEX] [-d DEV]   # two QPs, one process
    pyverbs_pingpong.py server PORT [-n ITERS] [-g GID_INDEX]        # the passive side
    pyverbs_pingpong.py client PORT [-n ITERS] [-g GID_INDEX]        # connects to 127.0.0.1

The two sides exchange QP number, PSN and GID over TCP, move their QPs to RTS and bounce a
message ITERS times (SEND/RECV), each checking the bytes it receives. Prints
"pingpong ok: N iterations" on success. It runs unchanged on real pyverbs (with an RDMA
device) and on softrdma (``softrdma run pyverbs_pingpong.py ...``).
"""

import argparse
import json
import socket
import sys
import time

import pyverbs.device as d
import pyverbs.enums as e
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsRDMAError
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

SIZE = 64


class Side:
    def __init__(self, ctx, pd, gid_index, tag):
        self.ctx, self.gid_index, self.tag = ctx, gid_index, tag
        self.cq = CQ(ctx, 16)
        self.mr = MR(pd, 2 * SIZE, e.IBV_ACCESS_LOCAL_WRITE)
        cap = QPCap(max_send_wr=4, max_recv_wr=4, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
        self.psn = 0x1000 + tag
        self.gid = ctx.query_gid(1, gid_index).gid

    def info(self):
        return {"qpn": self.qp.qp_num, "psn": self.psn, "gid": self.gid}

    def connect(self, peer):
        attr = QPAttr(qp_state=e.IBV_QPS_INIT, port_num=1)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE
        attr.pkey_index = 0
        self.qp.to_init(attr)
        attr.path_mtu = e.IBV_MTU_1024
        attr.dest_qp_num = peer["qpn"]
        attr.rq_psn = peer["psn"]
        attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = 12
        gr = GlobalRoute(dgid=GID(peer["gid"]), sgid_index=self.gid_index)
        attr.ah_attr = AHAttr(port_num=1, is_global=1, gr=gr)
        self.qp.to_rtr(attr)
        attr.sq_psn = self.psn
        attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.max_rd_atomic = 14, 7, 7, 1
        self.qp.to_rts(attr)

    def post_recv(self):
        self.qp.post_recv(RecvWR(wr_id=1, num_sge=1, sg=[SGE(self.mr.buf + SIZE, SIZE,
                                                              self.mr.lkey)]))

    def send(self, i):
        msg = f"{self.tag}:{i:08d}".ljust(SIZE, ".").encode()
        self.mr.write(msg, SIZE, 0)
        self.qp.post_send(SendWR(wr_id=2, opcode=e.IBV_WR_SEND, num_sge=1,
                                 sg=[SGE(self.mr.buf, SIZE, self.mr.lkey)]))

    def expect(self, peer_tag, i):
        data = self.mr.read(SIZE, SIZE)
        want = f"{peer_tag}:{i:08d}".ljust(SIZE, ".").encode()
        if data != want:
            raise SystemExit(f"iteration {i}: received {data!r}, expected {want!r}")


_early = {}  # completions polled while waiting for others: cq -> {wr_id: count}


def wait(cq, want, timeout=20.0):
    """Poll until ``want`` (wr_id -> count) completions arrived; all must succeed.
    Completions that arrive for other wr_ids are kept for the next call."""
    end = time.monotonic() + timeout
    got = _early.setdefault(id(cq), {})
    while any(got.get(k, 0) < v for k, v in want.items()):
        n, wcs = cq.poll(4)
        for wc in wcs:
            if wc.status != e.IBV_WC_SUCCESS:
                raise SystemExit(f"completion error: status {wc.status} wr_id {wc.wr_id}")
            got[wc.wr_id] = got.get(wc.wr_id, 0) + 1
        if not n and time.monotonic() > end:
            raise SystemExit(f"timeout waiting for completions {want}, got {got}")
    for k, v in want.items():
        got[k] -= v


def open_ctx(dev):
    name = dev or d.get_device_list()[0].name.decode()
    return d.Context(name=name)


def loopback(args):
    with open_ctx(args.dev) as ctx:
        pd = PD(ctx)
        a, b = Side(ctx, pd, args.gid, 1), Side(ctx, pd, args.gid, 2)
        a.connect(b.info())
        b.connect(a.info())
        for i in range(args.iters):
            b.post_recv()
            a.send(i)
            wait(a.cq, {2: 1})
            wait(b.cq, {1: 1})
            b.expect(1, i)
            a.post_recv()
            b.send(i)
            wait(b.cq, {2: 1})
            wait(a.cq, {1: 1})
            a.expect(2, i)
    print(f"pingpong ok: {args.iters} iterations")


def two_sides(args):
    server = args.mode == "server"
    if server:
        ls = socket.create_server(("127.0.0.1", args.port))
        conn, _ = ls.accept()
        ls.close()
    else:
        end = time.monotonic() + 20
        while True:
            try:
                conn = socket.create_connection(("127.0.0.1", args.port))
                break
            except OSError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.1)
    # one file per direction: a text file open for both discards its read-ahead when written
    f, w = conn.makefile("r"), conn.makefile("w")
    with open_ctx(args.dev) as ctx:
        pd = PD(ctx)
        me = Side(ctx, pd, args.gid, 2 if server else 1)
        w.write(json.dumps(me.info()) + "\n")
        w.flush()
        peer = json.loads(f.readline())
        print(f"{args.mode}: qpn {me.qp.qp_num} gid {me.gid}; peer qpn {peer['qpn']} "
              f"gid {peer['gid']}", file=sys.stderr)
        me.connect(peer)
        me.post_recv()  # before the peer may send: after the handshake below
        w.write("ready\n")
        w.flush()
        f.readline()
        for i in range(args.iters):
            if server:
                wait(me.cq, {1: 1})
                me.expect(1, i)
                me.post_recv()
                me.send(i)
                wait(me.cq, {2: 1})
            else:
                me.send(i)
                wait(me.cq, {2: 1, 1: 1})
                me.expect(2, i)
                me.post_recv()
        w.write("done\n")
        w.flush()
        f.readline()
    conn.close()
    print(f"pingpong ok: {args.iters} iterations")


def main():
    ap = argparse.ArgumentParser(description="RC ping-pong over pyverbs")
    ap.add_argument("mode", choices=["loopback", "server", "client"])
    ap.add_argument("port", nargs="?", type=int, default=18515)
    ap.add_argument("-n", "--iters", type=int, default=10)
    ap.add_argument("-g", "--gid", type=int, default=0)
    ap.add_argument("-d", "--dev", default=None)
    args = ap.parse_args()
    try:
        loopback(args) if args.mode == "loopback" else two_sides(args)
    except PyverbsRDMAError as ex:
        raise SystemExit(f"pyverbs error: {ex}")


if __name__ == "__main__":
    main()
