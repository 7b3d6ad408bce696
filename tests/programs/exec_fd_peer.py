"""The peer of tests/programs/exec_fd_wait.c (softrdma's Python API, SOFTRDMA_IP its
address): reads the program's "QPN PSN GID" on stdin, answers with its own on stdout,
connects an RC QP, waits for a line ("ready": the program sleeps in poll()), sends the
text given as argv[1] and checks its completion."""

from __future__ import annotations

import sys
import time

from softrdma.verbs_api import (CQ, MR, PD, QP, SGE, AHAttr, Context, GlobalRoute, QPAttr,
                                QPCap, QPInitAttr, SendWR, IBV_ACCESS_LOCAL_WRITE,
                                IBV_MTU_1024, IBV_QPT_RC, IBV_WR_SEND)


def main() -> None:
    text = sys.argv[1].encode()
    ctx = Context()
    pd = PD(ctx)
    mr = MR(pd, 4096, IBV_ACCESS_LOCAL_WRITE)
    mr.write(text, len(text))
    cq = CQ(ctx, 16)
    qp = QP(pd, QPInitAttr(qp_type=IBV_QPT_RC, scq=cq, rcq=cq, cap=QPCap(max_send_wr=4)))
    rqpn, rpsn, rgid = sys.stdin.readline().split()
    print(f"{qp.qp_num:06x} 000000 {ctx.query_gid(1, 1).raw.hex()}", flush=True)
    at = QPAttr(port_num=1, path_mtu=IBV_MTU_1024, dest_qp_num=int(rqpn, 16),
                rq_psn=int(rpsn, 16), max_dest_rd_atomic=1, min_rnr_timer=12, sq_psn=0,
                timeout=14, retry_cnt=7, rnr_retry=7, max_rd_atomic=1,
                ah_attr=AHAttr(is_global=1, port_num=1,
                               gr=GlobalRoute(dgid=bytes.fromhex(rgid), sgid_index=1,
                                              hop_limit=1)))
    qp.to_rts(at)
    assert sys.stdin.readline().strip() == "ready"
    time.sleep(0.2)  # the program is asleep in poll() by now (and if not, it still works)
    qp.post_send(SendWR(1, IBV_WR_SEND, sg=[SGE(mr.buf, len(text), mr.lkey)]))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        n, wcs = cq.poll(1)
        if n:
            assert wcs[0].status == 0, wcs[0]
            print("sent", flush=True)
            return
    raise SystemExit("the SEND did not complete")


if __name__ == "__main__":
    main()
