"""Immediate data across stacks on rxe0: softrdma.ibverbs <-> real pyverbs (Debian's; run
with the system python3). pyverbs passes imm_data raw (__be32), so a pyverbs receiver reads
ntohl(raw) as the value whose big-endian bytes were on the wire; softrdma's imm_data is that
value. Prints two lines ending ok=True (tests/test_ibverbs_hw.py runs it)."""
import socket, sys, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from pyverbs.device import Context as PC
from pyverbs.pd import PD as PPD
from pyverbs.cq import CQ as PCQ
from pyverbs.mr import MR as PMR
from pyverbs.qp import QP as PQP, QPInitAttr as PQIA, QPCap as PQC, QPAttr as PQA
from pyverbs.addr import AHAttr as PAH, GlobalRoute as PGR
from pyverbs.wr import RecvWR as PRWR, SGE as PSGE, SendWR as PSWR
import pyverbs.enums as e
from softrdma import verbs_api as v

ACC = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
pc = PC(name="rxe0"); ppd = PPD(pc); pcq = PCQ(pc, 16, None, None, 0); pmr = PMR(ppd, 4096, ACC)
pqp = PQP(ppd, PQIA(qp_type=e.IBV_QPT_RC, scq=pcq, rcq=pcq, cap=PQC(max_send_wr=8, max_recv_wr=8)))
ctx = v.Context(name="rxe0"); pd = v.PD(ctx); cq = v.CQ(ctx, 16); mr = v.MR(pd, 4096, ACC)
qp = v.QP(pd, v.QPInitAttr(qp_type=v.IBV_QPT_RC, scq=cq, rcq=cq, cap=v.QPCap(max_send_wr=8, max_recv_wr=8)))
gid = ctx.query_gid(1, 1)
a = PQA(qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET)
a.qp_access_flags = ACC; a.path_mtu = e.IBV_MTU_1024; a.dest_qp_num = qp.qp_num
a.rq_psn = 0; a.sq_psn = 0; a.max_rd_atomic = 1; a.max_dest_rd_atomic = 1; a.min_rnr_timer = 12
a.timeout = 14; a.retry_cnt = 7; a.rnr_retry = 7
a.ah_attr = PAH(gr=PGR(dgid=pc.query_gid(1, 1), sgid_index=1), is_global=1, port_num=1)
pqp.to_rts(a)
b = v.QPAttr(qp_access_flags=ACC, path_mtu=v.IBV_MTU_1024, dest_qp_num=pqp.qp_num,
             max_rd_atomic=1, max_dest_rd_atomic=1, min_rnr_timer=12, timeout=14,
             retry_cnt=7, rnr_retry=7)
b.ah_attr = v.AHAttr(is_global=1, port_num=1, gr=v.GlobalRoute(dgid=gid, sgid_index=1, hop_limit=64))
qp.to_rts(b)

def ppoll(n):
    out, end = [], time.time() + 10
    while len(out) < n and time.time() < end:
        k, w = pcq.poll(); out += w if k else []
    return out

def vpoll(n):
    out, end = [], time.time() + 10
    while len(out) < n and time.time() < end:
        out += cq.poll(n)[1]
    return out

# softrdma.ibverbs -> pyverbs
pqp.post_recv(PRWR(wr_id=1, num_sge=1, sg=[PSGE(pmr.buf, 64, pmr.lkey)]))
qp.post_send(v.SendWR(wr_id=2, opcode=v.IBV_WR_SEND_WITH_IMM, imm_data=0x11223344,
                      sg=[v.SGE(mr.buf, 4, mr.lkey)]))
(pw,) = ppoll(1); vpoll(1)
print(f"softrdma->pyverbs: pyverbs raw imm_data=0x{pw.imm_data:08x} ntohl=0x{socket.ntohl(pw.imm_data):08x} "
      f"ok={socket.ntohl(pw.imm_data) == 0x11223344}")
# pyverbs -> softrdma (pyverbs programs htonl themselves, as rdma-core's tests do)
qp.post_recv(v.RecvWR(wr_id=3, sg=[v.SGE(mr.buf, 64, mr.lkey)]))
pqp.post_send(PSWR(wr_id=4, opcode=e.IBV_WR_SEND_WITH_IMM, num_sge=1, imm_data=socket.htonl(0xCAFEBABE),
                   sg=[PSGE(pmr.buf, 4, pmr.lkey)], send_flags=e.IBV_SEND_SIGNALED))
ws = vpoll(1); ppoll(1)
print(f"pyverbs->softrdma: softrdma imm_data=0x{ws[0].imm_data:08x} ok={ws[0].imm_data == 0xCAFEBABE}")
ctx.close(); pqp.close(); pmr.close(); pcq.close(); ppd.close(); pc.close()
