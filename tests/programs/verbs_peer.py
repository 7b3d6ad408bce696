#!/usr/bin/env python3
"""One softrdma.verbs_api program, run unchanged on either backend: two peers exchange
RC and UD traffic and each checks what it received.

    verbs_peer.py server PORT [-d DEV] [-g GID_INDEX]
    verbs_peer.py client HOST PORT [-d DEV] [-g GID_INDEX]

``-d`` names the device: ``softrdma0`` (the soft backend; ``SOFTRDMA_IP`` gives its
address) or a libibverbs device such as ``rxe0`` (the ibverbs backend). Nothing else in
the program depends on the backend. The peers swap their QP numbers, GIDs, MR address and
rkey over TCP, then each one

- SENDs with immediate data on RC (its role in the payload, its tag as the immediate),
- RDMA WRITEs a pattern into the peer's MR and RDMA READs the peer's own pattern back,
- sends one UD datagram through an AH,

and checks the peer's SEND, immediate, WRITE, its READ result and the UD payload (with
the sender's QPN in the completion). Prints ``verbs_peer ok: <role> on <device>``.
"""

import argparse
import json
import socket
import sys
import time

from softrdma.verbs_api import (
    AH, CQ, MR, PD, QP, SGE, AHAttr, Context, GlobalRoute, QPAttr, QPCap, QPInitAttr, RecvWR,
    SendWR,
)
from softrdma.verbs_api import enums as E

QKEY = 0x11111111
SIZE = 4096  # more than one packet at path MTU 1024 (rxe in the lab)
GRH = 40
ACC = (E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_REMOTE_READ)


def pattern(role: str) -> bytes:
    seed = 7 if role == "server" else 11
    return bytes((i * seed + 3) & 0xFF for i in range(SIZE))


def poll(cq: CQ, n: int, timeout: float = 60.0) -> list:
    out, end = [], time.monotonic() + timeout
    while len(out) < n:
        if time.monotonic() > end:
            raise SystemExit(f"only {len(out)} of {n} completions: {out}")
        got, wcs = cq.poll(n - len(out))
        out += wcs[:got]
    bad = [w for w in out if w.status != E.IBV_WC_SUCCESS]
    if bad:
        raise SystemExit(f"failed completions: {bad}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["server", "client"])
    ap.add_argument("args", nargs="+")
    ap.add_argument("-d", "--device", default="softrdma0")
    ap.add_argument("-g", "--gid-index", type=int, default=1)
    a = ap.parse_args()
    peer_side = "client" if a.role == "server" else "server"
    ctx = Context(name=a.device)
    pd, cq = PD(ctx), CQ(ctx, 64)
    # [0, SIZE): my pattern (the peer READs it); [SIZE, 2 SIZE): the peer's WRITE lands;
    # [2 SIZE, 3 SIZE): the peer's SEND; [3 SIZE, 4 SIZE): my READ result; then UD
    mr = MR(pd, 5 * SIZE, ACC)
    mr.write(pattern(a.role), SIZE, 0)
    cap = QPCap(max_send_wr=8, max_recv_wr=8, max_send_sge=1, max_recv_sge=1)
    rc = QP(pd, QPInitAttr(qp_type=E.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap))
    ud = QP(pd, QPInitAttr(qp_type=E.IBV_QPT_UD, scq=cq, rcq=cq, cap=cap))
    gid = ctx.query_gid(1, a.gid_index)
    mtu = min(ctx.query_port(1).active_mtu, E.IBV_MTU_1024)
    ud.to_rts(QPAttr(qkey=QKEY, sq_psn=0))
    ud.post_recv(RecvWR(wr_id=2, sg=[SGE(mr.buf + 4 * SIZE, GRH + 64, mr.lkey)]))

    if a.role == "server":
        lsock = socket.create_server(("0.0.0.0", int(a.args[0])))
        print("listening", flush=True)
        sock, _ = lsock.accept()
    else:
        for _ in range(300):
            try:
                sock = socket.create_connection((a.args[0], int(a.args[1])), timeout=5)
                break
            except OSError:
                time.sleep(0.2)
        else:
            raise SystemExit("no server")
    f = sock.makefile("rwb")
    me = {"rc": rc.qp_num, "ud": ud.qp_num, "gid": str(gid), "addr": mr.buf, "rkey": mr.rkey}
    f.write((json.dumps(me) + "\n").encode())
    f.flush()
    peer = json.loads(f.readline())

    route = GlobalRoute(dgid=type(gid)(peer["gid"]), sgid_index=a.gid_index, hop_limit=64)
    attr = QPAttr(qp_access_flags=ACC, path_mtu=mtu, dest_qp_num=peer["rc"], rq_psn=0x100,
                  sq_psn=0x100, max_dest_rd_atomic=1, max_rd_atomic=1, min_rnr_timer=12,
                  timeout=14, retry_cnt=7, rnr_retry=7)
    attr.ah_attr = AHAttr(port_num=1, is_global=1, gr=route)
    rc.to_rts(attr)
    rc.post_recv(RecvWR(wr_id=1, sg=[SGE(mr.buf + 2 * SIZE, SIZE, mr.lkey)]))
    f.write(b"ready\n")
    f.flush()
    assert f.readline().strip() == b"ready"

    tag = 0x5E000000 | (1 if a.role == "server" else 2)
    send = SendWR(wr_id=10, opcode=E.IBV_WR_SEND_WITH_IMM, imm_data=tag,
                  sg=[SGE(mr.buf, SIZE, mr.lkey)])
    write = SendWR(wr_id=11, opcode=E.IBV_WR_RDMA_WRITE, sg=[SGE(mr.buf, SIZE, mr.lkey)])
    write.set_wr_rdma(peer["rkey"], peer["addr"] + SIZE)
    read = SendWR(wr_id=12, opcode=E.IBV_WR_RDMA_READ,
                  sg=[SGE(mr.buf + 3 * SIZE, SIZE, mr.lkey)])
    read.set_wr_rdma(peer["rkey"], peer["addr"])
    ah = AH(pd, attr=AHAttr(port_num=1, is_global=1, gr=route))
    dgram = SendWR(wr_id=13, sg=[SGE(mr.buf, 64, mr.lkey)])
    dgram.set_wr_ud(ah, peer["ud"], QKEY)
    for wr in (write, send, read, dgram):  # the WRITE before the SEND: RC keeps the order
        (ud if wr is dgram else rc).post_send(wr)
    wcs = poll(cq, 6)  # 4 sends, the peer's SEND, the peer's datagram
    by_id = {w.wr_id: w for w in wcs}
    theirs = pattern(peer_side)
    r = by_id[1]
    assert r.opcode == E.IBV_WC_RECV and r.wc_flags & E.IBV_WC_WITH_IMM, r
    assert r.imm_data == 0x5E000000 | (2 if a.role == "server" else 1), hex(r.imm_data)
    assert r.byte_len == SIZE and mr.read(SIZE, 2 * SIZE) == theirs, "SEND payload"
    # the peer's WRITE came before its SEND on the same QP, so it is in place now
    assert mr.read(SIZE, SIZE) == theirs, "RDMA WRITE payload"
    assert mr.read(SIZE, 3 * SIZE) == theirs, "RDMA READ result"
    u = by_id[2]
    assert u.src_qp == peer["ud"] and u.byte_len == GRH + 64, u
    assert mr.read(64, 4 * SIZE + GRH) == theirs[:64], "UD payload"
    f.write(b"done\n")
    f.flush()
    assert f.readline().strip() == b"done"  # the peer's READ of my memory is over
    print(f"verbs_peer ok: {a.role} on {a.device}", flush=True)
    ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
