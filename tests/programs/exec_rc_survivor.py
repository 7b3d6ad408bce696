"""The survivor of tests/test_exec_verbs.py's killed-peer test: the client side of
ibv_rc_pingpong's exchange (softrdma's Python API), which sends a few messages to the
server, says so, waits for a line on stdin (the test has killed the server meanwhile), then
sends once more and prints that completion's status and how long it took. Its QP has
retry_cnt 3 (7, ibv_rc_pingpong's, means "retry for ever" to rxe, and so to softrdma).

    python exec_rc_survivor.py PORT SERVER_IP        (SOFTRDMA_IP: this side's address)
"""

from __future__ import annotations

import random
import socket
import sys
import time

from softrdma.tools.pingpong import encode_dest, parse_dest
from softrdma.verbs_api import (CQ, MR, PD, QP, SGE, AHAttr, Context, GlobalRoute, QPAttr,
                                QPCap, QPInitAttr, SendWR, IBV_ACCESS_LOCAL_WRITE,
                                IBV_QPT_RC, IBV_WR_SEND, IBV_MTU_1024)


def wait_wc(cq: CQ, deadline: float):
    while time.monotonic() < deadline:
        n, wcs = cq.poll(1)
        if n:
            return wcs[0]
    raise SystemExit("no completion before the deadline")


def main() -> None:
    port, server = int(sys.argv[1]), sys.argv[2]
    ctx = Context()
    pd = PD(ctx)
    mr = MR(pd, 4096, IBV_ACCESS_LOCAL_WRITE)
    cq = CQ(ctx, 16)
    qp = QP(pd, QPInitAttr(qp_type=IBV_QPT_RC, scq=cq, rcq=cq, cap=QPCap(max_send_wr=16)))
    psn = random.getrandbits(24)
    gid = ctx.query_gid(1, 1).raw
    with socket.create_connection((server, port), timeout=30) as s:
        s.sendall(encode_dest(0, qp.qp_num, psn, gid))
        msg = b""
        while len(msg) < 52:
            msg += s.recv(52 - len(msg))
        _, rqpn, rpsn, rgid = parse_dest(msg)
        at = QPAttr(port_num=1, path_mtu=IBV_MTU_1024, dest_qp_num=rqpn, rq_psn=rpsn,
                    max_dest_rd_atomic=1, min_rnr_timer=12, sq_psn=psn, timeout=14,
                    retry_cnt=3, rnr_retry=7, max_rd_atomic=1,
                    ah_attr=AHAttr(is_global=1, port_num=1,
                                   gr=GlobalRoute(dgid=rgid, sgid_index=1, hop_limit=1)))
        qp.to_rts(at)
        s.sendall(b"done\0")
    wr = SendWR(1, IBV_WR_SEND, sg=[SGE(mr.buf, 64, mr.lkey)])
    for _ in range(3):
        qp.post_send(wr)
        wc = wait_wc(cq, time.monotonic() + 30)
        assert wc.status == 0, wc
    print("sent 3", flush=True)
    sys.stdin.readline()  # the server is dead now
    t = time.monotonic()
    qp.post_send(wr)
    wc = wait_wc(cq, t + 120)
    print(f"status {wc.status} after {time.monotonic() - t:.2f} s", flush=True)


if __name__ == "__main__":
    main()
