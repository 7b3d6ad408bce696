"""The requester of tests/programs/a19_peer.c written with softrdma's verbs API, for what a
C program on Debian 12 cannot post: FLUSH (rdma-core 44 has no ibv_wr_flush).

    python a19_requester.py [-p PORT] [-g GID_INDEX] [-r RETRY_CNT] [-t TIMEOUT] [-D] -o OP [-o OP ...] SERVER

Each OP is ``fl:TYPE:LEVEL:OFFSET:LENGTH`` (a FLUSH of placement type TYPE, selectivity
level LEVEL, at the server MR's address + OFFSET) or ``aw:OFFSET:HEX16`` (an ATOMIC
WRITE). Prints ``wc <status> <opcode> <byte_len>`` per completion, stops at the first
error, then tells the server it is done. The device is the default soft device
(``SOFTRDMA_IP`` chooses its address). ``-D`` drops the first answer the device receives
(softrdma's fault injector), so the first request is sent again; ``-r`` sets retry_cnt,
``-t`` the QP's timeout exponent (default 14: 67 ms).
"""

from __future__ import annotations

import argparse
import socket

from softrdma.verbs_api import (
    CQ, GID, MR, PD, QP, AHAttr, Context, GlobalRoute, QPAttr, QPCap, QPInitAttr, SendWR,
    get_device_list,
)
from softrdma.verbs_api import enums as e
from softrdma.verbs_api.device import get_soft_device

PSN = 0x2A2A2A


def exchange(sock: socket.socket, qpn: int, gid: bytes) -> tuple[int, int, bytes, int, int]:
    sock.sendall(f"{qpn:06x} {PSN:06x} {gid.hex()} {0:08x} {0:016x}\n".encode())
    line = b""
    while not line.endswith(b"\n"):
        chunk = sock.recv(1)
        if not chunk:
            raise SystemExit("FAIL the server closed the connection")
        line += chunk
    q, p, g, rkey, addr = line.split()
    return int(q, 16), int(p, 16), bytes.fromhex(g.decode()), int(rkey, 16), int(addr, 16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-p", "--port", type=int, default=18515)
    ap.add_argument("-g", "--gid-index", type=int, default=1)
    ap.add_argument("-o", "--op", action="append", default=[])
    ap.add_argument("-r", "--retry-cnt", type=int, default=7)
    ap.add_argument("-t", "--timeout", type=int, default=14)
    ap.add_argument("-D", "--drop-first-answer", action="store_true")
    ap.add_argument("server")
    args = ap.parse_args()
    ctx = Context(name=get_device_list()[0].name.decode())
    pd = PD(ctx)
    cq = CQ(ctx, 16, None, None, 0)
    MR(pd, 4096, e.IBV_ACCESS_LOCAL_WRITE)  # as the C peer has one
    qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq,
                           cap=QPCap(max_send_wr=16, max_recv_wr=4)))
    gid = ctx.query_gid(1, args.gid_index)
    sock = socket.create_connection((args.server, args.port), timeout=30)
    rqpn, rpsn, rgid, rkey, raddr = exchange(sock, qp.qp_num, bytes(gid.raw))
    a = QPAttr(qp_access_flags=e.IBV_ACCESS_REMOTE_WRITE, path_mtu=e.IBV_MTU_1024,
               dest_qp_num=rqpn, rq_psn=rpsn, sq_psn=PSN, max_dest_rd_atomic=4,
               max_rd_atomic=4, min_rnr_timer=12, timeout=args.timeout,
               retry_cnt=args.retry_cnt,
               rnr_retry=7)
    a.ah_attr = AHAttr(is_global=1, gr=GlobalRoute(dgid=GID(rgid), sgid_index=args.gid_index,
                                                    hop_limit=64))
    qp.to_rts(a)
    if args.drop_first_answer:
        get_soft_device().faults.rx.drop("RC_RDMA_READ_RESPONSE_ONLY")
    for k, op in enumerate(args.op):
        kind, *f = op.split(":")
        wr = SendWR(k, send_flags=e.IBV_SEND_SIGNALED)
        if kind == "fl":
            ptype, level, off, length = (int(x, 0) for x in f)
            wr.set_wr_flush(rkey, raddr + off, length, ptype, level)
        elif kind == "aw":
            wr.set_wr_atomic_write(rkey, raddr + int(f[0], 0), bytes.fromhex(f[1]))
        else:
            raise SystemExit(f"FAIL bad op {op}")
        qp.post_send(wr)
        while (wc := cq.poll())[0] == 0:
            pass
        w = wc[1][0]
        print(f"wc {int(w.status)} {int(w.opcode)} {w.byte_len}", flush=True)
        if w.status != e.IBV_WC_SUCCESS:
            break
    sock.sendall(b"done\n")
    sock.close()


if __name__ == "__main__":
    main()
