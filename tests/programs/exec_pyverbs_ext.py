"""Debian's compiled pyverbs (python3-pyverbs, Cython over libibverbs' verbs.h inlines)
driving the extended verbs, for tests/test_exec_ext.py: two RC QPs made with
ibv_create_qp_ex on one device, connected to each other, their CQs made with
ibv_create_cq_ex; every work request through the ibv_wr_* builders, every completion
through ibv_start_poll / ibv_next_poll / the read_* slots; memory windows of both types.
Prints one JSON line of what it saw. Run with /usr/bin/python3 under ``softrdma exec``.
"""

import ctypes
import errno
import json
import time

import pyverbs.enums as e
from pyverbs.addr import AHAttr, GlobalRoute
from pyverbs.cq import CQEX, CqInitAttrEx, PollCqAttr
from pyverbs.device import Context
from pyverbs.mr import MR, MW, MWBind, MWBindInfo
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsRDMAError
from pyverbs.qp import QPAttr, QPCap, QPEx, QPInitAttrEx
from pyverbs.wr import SGE, RecvWR, SendWR

ACCESS = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
          | e.IBV_ACCESS_REMOTE_ATOMIC | e.IBV_ACCESS_MW_BIND)
OPS = (e.IBV_QP_EX_WITH_SEND | e.IBV_QP_EX_WITH_SEND_WITH_IMM | e.IBV_QP_EX_WITH_RDMA_WRITE
       | e.IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | e.IBV_QP_EX_WITH_RDMA_READ
       | e.IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP | e.IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD
       | e.IBV_QP_EX_WITH_BIND_MW | e.IBV_QP_EX_WITH_LOCAL_INV)
SIGNALED = e.IBV_SEND_SIGNALED


def poll(cq: CQEX, n: int) -> list:
    """n completions, through start_poll/next_poll/end_poll (a generous deadline)."""
    out: list = []
    deadline = time.monotonic() + 30
    while len(out) < n and time.monotonic() < deadline:
        if cq.start_poll(PollCqAttr()) == errno.ENOENT:
            time.sleep(0.001)
            continue
        while True:
            out.append([cq.wr_id, cq.status, cq.read_opcode(), cq.read_byte_len(),
                        cq.read_wc_flags(), cq.read_imm_data() if
                        cq.read_wc_flags() & e.IBV_WC_WITH_IMM else None])
            if len(out) == n or cq.poll_next() == errno.ENOENT:
                break
        cq.end_poll()
    return out


def main() -> None:
    ctx = Context(name="softrdma0")
    pd = PD(ctx)
    out: dict = {}
    cqs = [CQEX(ctx, CqInitAttrEx(cqe=64, wc_flags=e.IBV_WC_STANDARD_FLAGS)) for _ in range(2)]
    # rxe refuses completion timestamps: EOPNOTSUPP
    try:
        CQEX(ctx, CqInitAttrEx(cqe=8, wc_flags=e.IBV_WC_EX_WITH_COMPLETION_TIMESTAMP))
        out["ts_cq"] = "created"
    except PyverbsRDMAError as ex:
        out["ts_cq"] = ex.error_code
    qps = []
    for cq in cqs:
        cap = QPCap(max_send_wr=32, max_recv_wr=32, max_send_sge=2, max_recv_sge=2,
                    max_inline_data=64)
        qps.append(QPEx(ctx, QPInitAttrEx(
            qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, pd=pd, send_ops_flags=OPS,
            comp_mask=e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS)))
    gid = ctx.query_gid(1, 1)
    for me, peer in ((qps[0], qps[1]), (qps[1], qps[0])):
        attr = QPAttr(qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET)
        attr.qp_access_flags = ACCESS
        attr.path_mtu = e.IBV_MTU_1024
        attr.dest_qp_num = peer.qp_num
        attr.max_rd_atomic = attr.max_dest_rd_atomic = 4
        attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.min_rnr_timer = 14, 7, 7, 1
        attr.ah_attr = AHAttr(gr=GlobalRoute(dgid=gid, sgid_index=1), is_global=1, port_num=1)
        me.to_rts(attr)
    a, b = qps
    mra, mrb = MR(pd, 4096, ACCESS), MR(pd, 4096, ACCESS)

    # SEND with an SGE, and SEND_WITH_IMM with inline data from an unregistered buffer
    # that changes right after the call (the builder copies it)
    for i in range(2):
        b.post_recv(RecvWR(wr_id=100 + i, num_sge=1, sg=[SGE(mrb.buf + 64 * i, 64, mrb.lkey)]))
    mra.write(b"hello through ibv_wr_send", 25, 0)
    scratch = ctypes.create_string_buffer(b"inline bytes", 12)
    a.wr_start()
    a.wr_id, a.wr_flags = 1, SIGNALED
    a.wr_send()
    a.wr_set_sge(SGE(mra.buf, 25, mra.lkey))
    a.wr_id, a.wr_flags = 2, SIGNALED | e.IBV_SEND_INLINE
    a.wr_send_imm(0x12345678)
    a.wr_set_inline_data(ctypes.addressof(scratch), 12)
    ctypes.memmove(scratch, b"XXXXXXXXXXXX", 12)
    out["complete_send"] = a.wr_complete()
    out["send_cqes"] = poll(cqs[0], 2)
    out["recv_cqes"] = poll(cqs[1], 2)
    out["recv_data"] = [mrb.read(25, 0).decode(), mrb.read(12, 64).decode()]

    # RDMA WRITE with immediate, RDMA READ, the two atomics: one batch
    b.post_recv(RecvWR(wr_id=200, num_sge=1, sg=[SGE(mrb.buf + 3500, 8, mrb.lkey)]))
    mra.write(b"written", 7, 256)
    mrb.write(b"read me", 7, 512)
    mrb.write((40).to_bytes(8, "little"), 8, 1024)
    mrb.write((7).to_bytes(8, "little"), 8, 1032)
    a.wr_start()
    a.wr_id, a.wr_flags = 3, SIGNALED
    a.wr_rdma_write_imm(mrb.rkey, mrb.buf + 256, 0xCAFE)
    a.wr_set_sge(SGE(mra.buf + 256, 7, mra.lkey))
    a.wr_id = 4
    a.wr_rdma_read(mrb.rkey, mrb.buf + 512)
    a.wr_set_sge(SGE(mra.buf + 512, 7, mra.lkey))
    a.wr_id = 5
    a.wr_atomic_fetch_add(mrb.rkey, mrb.buf + 1024, 2)
    a.wr_set_sge(SGE(mra.buf + 1024, 8, mra.lkey))
    a.wr_id = 6
    a.wr_atomic_cmp_swp(mrb.rkey, mrb.buf + 1032, 7, 99)
    a.wr_set_sge(SGE(mra.buf + 1032, 8, mra.lkey))
    out["complete_batch"] = a.wr_complete()
    out["batch_cqes"] = poll(cqs[0], 4)
    out["imm_cqe"] = poll(cqs[1], 1)
    out["batch_data"] = [mrb.read(7, 256).decode(), mra.read(7, 512).decode(),
                         int.from_bytes(mra.read(8, 1024), "little"),
                         int.from_bytes(mrb.read(8, 1024), "little"),
                         int.from_bytes(mra.read(8, 1032), "little"),
                         int.from_bytes(mrb.read(8, 1032), "little")]

    # the builders' own errors: inline data past max_inline_data is ENOSPC at complete,
    # wr_abort drops a batch
    a.wr_start()
    a.wr_id, a.wr_flags = 7, SIGNALED | e.IBV_SEND_INLINE
    a.wr_send()
    big = ctypes.create_string_buffer(4096)
    a.wr_set_inline_data(ctypes.addressof(big), 4096)
    try:
        out["complete_too_long"] = a.wr_complete()
    except PyverbsRDMAError as ex:
        out["complete_too_long"] = ex.error_code
    a.wr_start()
    a.wr_send()
    a.wr_abort()

    # memory windows: type 2 bound by ibv_wr_bind_mw, type 1 by ibv_bind_mw; then an
    # RDMA WRITE through each window's rkey
    mw2, mw1 = MW(pd, e.IBV_MW_TYPE_2), MW(pd, e.IBV_MW_TYPE_1)
    rkey2 = (mw2.rkey & ~0xFF) | ((mw2.rkey + 1) & 0xFF)
    b.wr_start()
    b.wr_id, b.wr_flags = 8, SIGNALED
    b.wr_bind_mw(mw2, rkey2, MWBindInfo(mrb, mrb.buf + 2048, 64, e.IBV_ACCESS_REMOTE_WRITE))
    out["complete_bind2"] = b.wr_complete()
    old1 = mw1.rkey
    b.bind_mw(mw1, MWBind(MWBindInfo(mrb, mrb.buf + 3072, 64, e.IBV_ACCESS_REMOTE_WRITE),
                          SIGNALED, 9))
    out["mw1_rkey_moved"] = mw1.rkey == ((old1 & ~0xFF) | ((old1 + 1) & 0xFF))
    # and a type 2 window bound by ibv_post_send's IBV_WR_BIND_MW
    mw3 = MW(pd, e.IBV_MW_TYPE_2)
    bind = SendWR(wr_id=13, opcode=e.IBV_WR_BIND_MW, send_flags=SIGNALED)
    bind.set_bind_wr(mw3, MWBindInfo(mrb, mrb.buf + 3584, 64, e.IBV_ACCESS_REMOTE_WRITE))
    b.post_send(bind)
    rkey3 = (mw3.rkey & ~0xFF) | ((mw3.rkey + 1) & 0xFF)
    out["bind_cqes"] = poll(cqs[1], 3)
    mra.write(b"via mw2!via mw1!", 16, 0)
    a.wr_start()
    a.wr_id, a.wr_flags = 10, SIGNALED
    a.wr_rdma_write(rkey2, mrb.buf + 2048)
    a.wr_set_sge(SGE(mra.buf, 8, mra.lkey))
    a.wr_id = 11
    a.wr_rdma_write(mw1.rkey, mrb.buf + 3072)
    a.wr_set_sge(SGE(mra.buf + 8, 8, mra.lkey))
    a.wr_id = 14
    a.wr_rdma_write(rkey3, mrb.buf + 3584)
    a.wr_set_sge(SGE(mra.buf, 8, mra.lkey))
    out["complete_mw_writes"] = a.wr_complete()
    out["mw_write_cqes"] = poll(cqs[0], 3)
    out["mw_data"] = [mrb.read(8, 2048).decode(), mrb.read(8, 3072).decode(),
                      mrb.read(8, 3584).decode()]
    # outside the window: a remote access error, and the QP goes to the error state
    a.wr_start()
    a.wr_id = 12
    a.wr_rdma_write(rkey2, mrb.buf + 2048 + 60)
    a.wr_set_sge(SGE(mra.buf, 8, mra.lkey))
    a.wr_complete()
    out["mw_outside_cqe"] = poll(cqs[0], 1)
    # windows before their MR (rxe: an MR with windows bound is EINVAL to deregister)
    for obj in (a, b, mw1, mw2, mw3, mra, mrb, *cqs, pd, ctx):
        obj.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
