"""Two unmodified verbs programs on one host, as ibv_*_pingpong pairs run: each opens the
first device of its own device list and they exchange QPN, PSN, GID (and for RC the rkey
and address of a buffer) over TCP, then talk over the soft devices.

    python two_procs.py server PORT {rc,ud}
    python two_procs.py client PORT {rc,ud}

RC: the client SENDs a message, the server answers with an RDMA WRITE into the client's
buffer, the client RDMA READs the server's buffer. UD: the client SENDs a datagram, the
server SENDs one back. Each side checks the data and prints ``OK <its GID>``.
"""

import json
import random
import socket
import sys
import time

from softrdma.verbs_api import (
    AH, CQ, MR, PD, QP, SGE, AHAttr, Context, GlobalRoute, QPAttr, QPCap, QPInitAttr, RecvWR,
    SendWR, get_device_list,
)
from softrdma.verbs_api import enums as e

SIZE = 4096
QKEY = 0x11111111
GRH = 40  # a UD receive starts with 40 bytes of GRH
ACCESS = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ


def poll_cq(cq, timeout=20):
    end = time.monotonic() + timeout
    while True:
        n, wcs = cq.poll(1)
        if n:
            if wcs[0].status != e.IBV_WC_SUCCESS:
                raise RuntimeError(f"completion failed: {wcs[0]}")
            return wcs[0]
        if time.monotonic() > end:
            raise RuntimeError("polling timed out")


def exchange(role, port, mine):
    if role == "server":
        ls = socket.create_server(("127.0.0.1", port))
        conn, _ = ls.accept()
        ls.close()
    else:
        end = time.monotonic() + 20
        while True:
            try:
                conn = socket.create_connection(("127.0.0.1", port))
                break
            except ConnectionRefusedError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.05)
    # one file per direction: a text file open for both discards read-ahead on write
    r, w = conn.makefile("r"), conn.makefile("w")
    w.write(json.dumps(mine) + "\n")
    w.flush()
    theirs = json.loads(r.readline())
    return conn, r, w, theirs


def main(role, port, kind):
    ctx = Context(name=get_device_list()[0].name.decode())
    pd = PD(ctx)
    cq = CQ(ctx, 64, None, None, 0)
    mr = MR(pd, SIZE, ACCESS)
    qpt = e.IBV_QPT_RC if kind == "rc" else e.IBV_QPT_UD
    cap = QPCap(max_send_wr=8, max_recv_wr=8, max_send_sge=1, max_recv_sge=1)
    qp = QP(pd, QPInitAttr(qp_type=qpt, scq=cq, rcq=cq, cap=cap))
    gid = ctx.query_gid(1, 1)
    psn = random.getrandbits(24)
    mine = {"qpn": qp.qp_num, "psn": psn, "gid": str(gid), "rkey": mr.rkey, "addr": mr.buf}
    attr = QPAttr(qp_access_flags=ACCESS, port_num=1, qkey=QKEY)
    qp.to_init(attr)
    qp.post_recv(RecvWR(wr_id=1, num_sge=1, sg=[SGE(mr.buf, SIZE, mr.lkey)]))
    conn, f, w, peer = exchange(role, port, mine)
    gr = GlobalRoute(dgid=peer["gid"], sgid_index=1)
    ah_attr = AHAttr(gr=gr, is_global=1, port_num=1)
    if kind == "rc":
        attr.ah_attr = ah_attr
        attr.dest_qp_num, attr.rq_psn, attr.sq_psn = peer["qpn"], peer["psn"], psn
        attr.path_mtu = e.IBV_MTU_1024
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        qp.to_rtr(attr)
        qp.to_rts(attr)
    else:
        attr.sq_psn = psn
        qp.to_rtr(attr)
        qp.to_rts(attr)
        ah = AH(pd, attr=ah_attr)
    w.write("ready\n")
    w.flush()
    line = f.readline()
    assert line.strip() == "ready", repr(line)

    def send(data, wr_id):
        mr.write(data, len(data), SIZE // 2)
        wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_SEND, num_sge=1,
                    sg=[SGE(mr.buf + SIZE // 2, len(data), mr.lkey)],
                    send_flags=e.IBV_SEND_SIGNALED)
        if kind == "ud":
            wr.set_wr_ud(ah, peer["qpn"], QKEY)
        qp.post_send(wr)
        poll_cq(cq)

    ask = b"question from the client " * 10
    answer = b"answer from the server " * 20
    if kind == "rc":
        if role == "client":
            send(ask, 2)
            assert f.readline().strip() == "written"
            assert mr.read(len(answer), 0) == answer
            wr = SendWR(wr_id=3, opcode=e.IBV_WR_RDMA_READ, num_sge=1,
                        sg=[SGE(mr.buf + 1024, 100, mr.lkey)], send_flags=e.IBV_SEND_SIGNALED)
            wr.set_wr_rdma(peer["rkey"], peer["addr"] + 3072)
            qp.post_send(wr)
            poll_cq(cq)
            assert mr.read(100, 1024) == b"S" * 100
        else:
            mr.write(b"S" * 100, 100, 3072)
            wc = poll_cq(cq)
            assert wc.byte_len == len(ask) and mr.read(len(ask), 0) == ask
            mr.write(answer, len(answer), SIZE // 2)
            wr = SendWR(wr_id=4, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
                        sg=[SGE(mr.buf + SIZE // 2, len(answer), mr.lkey)],
                        send_flags=e.IBV_SEND_SIGNALED)
            wr.set_wr_rdma(peer["rkey"], peer["addr"])
            qp.post_send(wr)
            poll_cq(cq)
            w.write("written\n")
            w.flush()
            f.readline()  # the client's READ is done when it hangs up
    else:
        if role == "client":
            send(ask, 2)
            wc = poll_cq(cq)
            assert mr.read(len(answer), GRH) == answer, wc
        else:
            wc = poll_cq(cq)
            assert wc.byte_len == GRH + len(ask) and mr.read(len(ask), GRH) == ask, wc
            qp.post_recv(RecvWR(wr_id=1, num_sge=1, sg=[SGE(mr.buf, SIZE // 2, mr.lkey)]))
            send(answer, 2)
    print("OK", gid, flush=True)
    conn.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
