"""A verbs program as rdma-core's pyverbs tests write one: only its imports name softrdma.

Two RC QPs on the first device of the device list, connected to each other; SEND, RDMA
WRITE, RDMA READ, FETCH_AND_ADD and CMP_AND_SWAP with the data checked, then a WRITE with a
wrong rkey, which must fail with IBV_WC_REM_ACCESS_ERR. Completions are busy-polled, as
rdma-core's ``tests/utils.py`` does. Nothing here drives the device: no progress calls, no
close at the end (the process must still exit at once). Prints ``OK`` when all passed.
"""

import struct
import sys
import time

from softrdma.verbs_api import (  # pyverbs: pyverbs.device, .pd, .cq, .mr, .qp, .addr, .wr
    CQ, MR, PD, QP, SGE, AHAttr, Context, GlobalRoute, QPAttr, QPCap, QPInitAttr, RecvWR,
    SendWR, get_device_list,
)
from softrdma.verbs_api import enums as e  # pyverbs: import pyverbs.enums as e

SIZE = 4096
ACCESS = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
          | e.IBV_ACCESS_REMOTE_ATOMIC)


def poll_cq(cq, count=1, timeout=10):
    wcs = []
    end = time.monotonic() + timeout
    while len(wcs) < count:
        n, got = cq.poll(count - len(wcs))
        wcs += got
        if time.monotonic() > end:
            raise RuntimeError(f"polling timed out: {len(wcs)} of {count} completions")
    return wcs


def expect_success(wcs):
    for wc in wcs:
        if wc.status != e.IBV_WC_SUCCESS:
            raise RuntimeError(f"completion failed: {wc}")


class Side:
    def __init__(self, ctx, pd):
        self.cq = CQ(ctx, 100, None, None, 0)
        self.mr = MR(pd, SIZE, ACCESS)
        cap = QPCap(max_send_wr=16, max_recv_wr=16, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))

    def connect(self, ctx, remote_qpn, gid_index):
        attr = QPAttr(qp_access_flags=ACCESS, port_num=1)
        self.qp.to_init(attr)
        gr = GlobalRoute(dgid=ctx.query_gid(1, gid_index), sgid_index=gid_index)
        attr.ah_attr = AHAttr(gr=gr, is_global=1, port_num=1)
        attr.dest_qp_num = remote_qpn
        attr.path_mtu = e.IBV_MTU_1024
        attr.rq_psn = attr.sq_psn = 0
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.timeout, attr.retry_cnt, attr.rnr_retry = 14, 7, 7
        self.qp.to_rtr(attr)
        self.qp.to_rts(attr)

    def sge(self, offset=0, length=SIZE):
        return SGE(self.mr.buf + offset, length, self.mr.lkey)


def main():
    dev_name = get_device_list()[0].name.decode()
    ctx = Context(name=dev_name)
    pd = PD(ctx)
    a, b = Side(ctx, pd), Side(ctx, pd)
    gid_index = 1  # the RoCEv2 GID of the device's IP address
    a.connect(ctx, b.qp.qp_num, gid_index)
    b.connect(ctx, a.qp.qp_num, gid_index)

    # SEND / RECV
    msg = b"hello from a verbs program"
    a.mr.write(msg, len(msg))
    b.qp.post_recv(RecvWR(wr_id=1, num_sge=1, sg=[b.sge()]))
    a.qp.post_send(SendWR(wr_id=2, opcode=e.IBV_WR_SEND, num_sge=1, sg=[a.sge(0, len(msg))],
                          send_flags=e.IBV_SEND_SIGNALED))
    expect_success(poll_cq(a.cq))
    (wc,) = poll_cq(b.cq)
    expect_success([wc])
    assert wc.byte_len == len(msg) and b.mr.read(len(msg), 0) == msg, wc

    # RDMA WRITE
    data = bytes(range(256)) * 4
    a.mr.write(data, len(data), 0)
    wr = SendWR(wr_id=3, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[a.sge(0, len(data))],
                send_flags=e.IBV_SEND_SIGNALED)
    wr.set_wr_rdma(b.mr.rkey, b.mr.buf + 1024)
    a.qp.post_send(wr)
    expect_success(poll_cq(a.cq))
    assert b.mr.read(len(data), 1024) == data

    # RDMA READ
    b.mr.write(b"R" * 512, 512, 2048)
    wr = SendWR(wr_id=4, opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[a.sge(3072, 512)],
                send_flags=e.IBV_SEND_SIGNALED)
    wr.set_wr_rdma(b.mr.rkey, b.mr.buf + 2048)
    a.qp.post_send(wr)
    expect_success(poll_cq(a.cq))
    assert a.mr.read(512, 3072) == b"R" * 512

    # FETCH_AND_ADD then CMP_AND_SWAP on a 64-bit word of b's memory
    b.mr.write(struct.pack("<Q", 100), 8, 512)
    wr = SendWR(wr_id=5, opcode=e.IBV_WR_ATOMIC_FETCH_AND_ADD, num_sge=1, sg=[a.sge(8, 8)],
                send_flags=e.IBV_SEND_SIGNALED)
    wr.set_wr_atomic(b.mr.rkey, b.mr.buf + 512, 5)
    a.qp.post_send(wr)
    expect_success(poll_cq(a.cq))
    assert struct.unpack("<Q", a.mr.read(8, 8))[0] == 100
    assert struct.unpack("<Q", b.mr.read(8, 512))[0] == 105
    wr = SendWR(wr_id=6, opcode=e.IBV_WR_ATOMIC_CMP_AND_SWP, num_sge=1, sg=[a.sge(16, 8)],
                send_flags=e.IBV_SEND_SIGNALED)
    wr.set_wr_atomic(b.mr.rkey, b.mr.buf + 512, 105, 999)
    a.qp.post_send(wr)
    expect_success(poll_cq(a.cq))
    assert struct.unpack("<Q", a.mr.read(8, 16))[0] == 105
    assert struct.unpack("<Q", b.mr.read(8, 512))[0] == 999

    # a wrong rkey: the responder NAKs, the requester completes with REM_ACCESS_ERR
    wr = SendWR(wr_id=7, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[a.sge(0, 64)],
                send_flags=e.IBV_SEND_SIGNALED)
    wr.set_wr_rdma(b.mr.rkey ^ 0x5A5A, b.mr.buf)
    a.qp.post_send(wr)
    (wc,) = poll_cq(a.cq)
    assert wc.status == e.IBV_WC_REM_ACCESS_ERR, wc
    print("OK", dev_name, ctx.query_gid(1, gid_index), flush=True)
    # no close: the process must exit by itself, promptly


if __name__ == "__main__":
    sys.exit(main())
