#!/usr/bin/env python3
"""One RDMA WRITE loop, written against pyverbs and nothing else (``softrdma bench verbs``
runs it three ways: Debian's real pyverbs, ``softrdma run`` on the device's backend, and
beside perftest's ``ib_write_bw``).

    pyverbs_write_loop.py DEVICE GID_INDEX SIZE ITERS [TX_DEPTH]

Two RC QPs of one context are connected to each other (loopback through the device, as
``ib_write_bw`` does on one host); QP A writes SIZE bytes ITERS times into QP B's MR,
keeping up to TX_DEPTH (default 64) signalled writes outstanding and polling the CQ in
batches, like perftest's write_bw loop. Prints one JSON line: bytes, seconds, MB/s
(10^6 bytes, as perftest), messages/s. The first and last 4 bytes of the target are
checked, so a loop that moves nothing cannot report a number.

This file is a program, not a module of softrdma: it imports ``pyverbs`` and is never
imported by the package.
"""

import json
import sys
import time

import pyverbs.enums as e
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, SendWR


def main(argv: list) -> int:
    dev, gid_index, size, iters = argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    depth = int(argv[5]) if len(argv) > 5 else 64
    ctx = Context(name=dev)
    pd = PD(ctx)
    cq = CQ(ctx, 2 * depth)
    acc = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
    src, dst = MR(pd, size, acc), MR(pd, size, acc)
    pattern = bytes((i * 7 + 3) & 0xFF for i in range(size))
    src.write(pattern, size, 0)
    cap = QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    qa, qb = (QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap))
              for _ in range(2))
    gid = ctx.query_gid(1, gid_index)
    mtu = ctx.query_port(1).active_mtu
    for me, peer, psn, ppsn in ((qa, qb, 0x100, 0x200), (qb, qa, 0x200, 0x100)):
        a = QPAttr(qp_state=e.IBV_QPS_INIT, port_num=1)
        a.qp_access_flags = acc
        a.pkey_index = 0
        me.to_init(a)
        a.path_mtu, a.dest_qp_num, a.rq_psn = mtu, peer.qp_num, ppsn
        a.max_dest_rd_atomic, a.min_rnr_timer = 1, 12
        a.ah_attr = AHAttr(port_num=1, is_global=1,
                           gr=GlobalRoute(dgid=GID(str(gid)), sgid_index=gid_index))
        me.to_rtr(a)
        a.sq_psn, a.timeout, a.retry_cnt, a.rnr_retry, a.max_rd_atomic = psn, 14, 7, 7, 1
        me.to_rts(a)
    wr = SendWR(wr_id=1, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
                sg=[SGE(src.buf, size, src.lkey)], send_flags=e.IBV_SEND_SIGNALED)
    wr.set_wr_rdma(dst.rkey, dst.buf)
    posted = done = 0
    t0 = time.perf_counter()
    while done < iters:
        while posted < iters and posted - done < depth:
            qa.post_send(wr)
            posted += 1
        n, wcs = cq.poll(depth)
        for wc in wcs[:n]:
            if wc.status != e.IBV_WC_SUCCESS:
                raise SystemExit(f"write {done} completed with status {wc.status}")
        done += n
    secs = time.perf_counter() - t0
    got = dst.read(size, 0)
    if got[:4] != pattern[:4] or got[-4:] != pattern[-4:]:
        raise SystemExit("the target MR does not hold what was written")
    print(json.dumps({"size": size, "iters": iters, "seconds": secs,
                      "MBps": size * iters / secs / 1e6, "msg_per_s": iters / secs}))
    for o in (qa, qb, src, dst, cq, pd, ctx):
        o.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
