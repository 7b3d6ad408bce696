"""A softrdma program does RDMA WRITE, READ, FETCH_AND_ADD and COMPARE_AND_SWAP against
memory that a pyverbs program registered on kernel rxe in the guest; both sides check the
data."""

from __future__ import annotations

import json
import time

import pytest

from softrdma.harness.lab import HOST_IP, guest_ip

# Runs in the guest with Debian's python3 and rdma-core's pyverbs on rxe0.
GUEST = r'''
import json, socket, struct
from pyverbs.device import Context
from pyverbs.pd import PD
from pyverbs.mr import MR
from pyverbs.cq import CQ
from pyverbs.qp import QP, QPInitAttr, QPCap, QPAttr
from pyverbs.addr import AHAttr, GlobalRoute, GID
try:
    import pyverbs.libibverbs_enums as e   # rdma-core >= 45
except ImportError:
    import pyverbs.enums as e              # rdma-core 44 (Debian 12)
ctx = Context(name="rxe0"); pd = PD(ctx); cq = CQ(ctx, 16)
acc = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
       | e.IBV_ACCESS_REMOTE_ATOMIC)
mr = MR(pd, 65536, acc)
mr.write(bytes((i * 13 + 5) & 0xFF for i in range(8192)), 8192, 0)   # what the host reads
mr.write(struct.pack("<Q", 100), 8, 16384)                            # the atomic word
qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=QPCap(max_send_wr=4, max_recv_wr=4)))
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("GUEST_IP", 7801)); s.listen(1); c, _ = s.accept(); f = c.makefile("rwb")
mine = {"qpn": qp.qp_num, "psn": 0x4242, "gid": ctx.query_gid(1, 1).gid, "addr": mr.buf, "rkey": mr.rkey}
f.write((json.dumps(mine) + "\n").encode()); f.flush()
peer = json.loads(f.readline())
a = QPAttr(port_num=1)
a.qp_access_flags = acc
a.path_mtu = e.IBV_MTU_1024; a.max_dest_rd_atomic = a.max_rd_atomic = 4
a.min_rnr_timer, a.timeout, a.retry_cnt, a.rnr_retry = 12, 14, 7, 7
a.ah_attr = AHAttr(port_num=1, is_global=1, gr=GlobalRoute(dgid=GID(peer["gid"]), sgid_index=1, hop_limit=64))
a.dest_qp_num, a.rq_psn, a.sq_psn = peer["qpn"], peer["psn"], 0x4242
qp.to_rts(a)
f.write(b"ready\n"); f.flush()
assert f.readline().strip() == b"done"
report = {"written": mr.read(8192, 32768).hex(), "word": struct.unpack("<Q", mr.read(8, 16384))[0]}
f.write((json.dumps(report) + "\n").encode()); f.flush()
print("guest ok")
'''


@pytest.mark.kernels("6.1", "6.12")
def test_softrdma_program_against_pyverbs_memory_on_rxe(scenario):
    lab = scenario
    (lab.dir / "guest_verbs.py").write_text(GUEST.replace("GUEST_IP", guest_ip(0)))
    job = lab.guest_start(0, f"timeout 120 /usr/bin/python3 {lab.dir}/guest_verbs.py")
    time.sleep(2.0)
    host_prog = f'''
import json, socket, struct, time
from softrdma.verbs_api import *
from softrdma.verbs_api.device import add_device
dev = add_device("{HOST_IP}", name="interop"); dev.attach_udp()
ctx = Context(name="interop"); pd = PD(ctx); cq = CQ(ctx, 16)
mr = MR(pd, 65536, IBV_ACCESS_LOCAL_WRITE)
qp = QP(pd, QPInitAttr(qp_type=IBV_QPT_RC, scq=cq, rcq=cq, cap=QPCap(max_send_wr=8, max_recv_wr=4)))
for attempt in range(100):
    try:
        c = socket.create_connection(("{guest_ip(0)}", 7801), timeout=5); break
    except OSError:
        if attempt == 99: raise
        time.sleep(0.2)
f = c.makefile("rwb")
peer = json.loads(f.readline())
f.write((json.dumps({{"qpn": qp.qp_num, "psn": 0x777, "gid": ctx.query_gid(1, 1).gid}}) + "\\n").encode()); f.flush()
a = QPAttr(port_num=1)
a.path_mtu = IBV_MTU_1024; a.max_dest_rd_atomic = a.max_rd_atomic = 4
a.min_rnr_timer, a.timeout, a.retry_cnt, a.rnr_retry = 12, 14, 7, 7
a.ah_attr = AHAttr(port_num=1, is_global=1, gr=GlobalRoute(dgid=GID(peer["gid"]), sgid_index=1, hop_limit=64))
a.dest_qp_num, a.rq_psn, a.sq_psn = peer["qpn"], peer["psn"], 0x777
qp.to_rts(a)
assert f.readline().strip() == b"ready"
pattern = bytes((i * 7 + 1) & 0xFF for i in range(8192))
mr.write(pattern, 8192, 0)
def op(opcode, local, length, remote, cmp_add=0, swap=0):
    wr = SendWR(opcode, opcode=opcode, sg=[SGE(mr.buf + local, length, mr.lkey)])
    wr.set_wr_atomic(peer["rkey"], peer["addr"] + remote, cmp_add, swap)
    qp.post_send(wr)
op(IBV_WR_RDMA_WRITE, 0, 8192, 32768)
op(IBV_WR_RDMA_READ, 16384, 8192, 0)
op(IBV_WR_ATOMIC_FETCH_AND_ADD, 40000, 8, 16384, 5)
op(IBV_WR_ATOMIC_CMP_AND_SWP, 40008, 8, 16384, 105, 999)
t = time.time(); wcs = []
while len(wcs) < 4 and time.time() - t < 30:
    wcs += cq.poll_all(); time.sleep(0.001)
f.write(b"done\\n"); f.flush()
rep = json.loads(f.readline())
print(json.dumps({{"status": [w.status for w in wcs], "ops": [w.opcode for w in wcs],
                  "read_ok": mr.read(8192, 16384) == bytes((i * 13 + 5) & 0xFF for i in range(8192)),
                  "faa_orig": struct.unpack("<Q", mr.read(8, 40000))[0],
                  "cas_orig": struct.unpack("<Q", mr.read(8, 40008))[0],
                  "guest_written_ok": bytes.fromhex(rep["written"]) == pattern,
                  "guest_word": rep["word"]}}))
ctx.close(); dev.detach()
'''
    r = lab.host(["python3", "-c", host_prog], timeout=150)
    g = job.wait(150)
    assert g.rc == 0 and "guest ok" in g.stdout, f"guest: {g.stderr}\nhost: {r.stderr}"
    assert r.rc == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["status"] == [0, 0, 0, 0]
    assert res["ops"] == [1, 2, 4, 3]  # RDMA_WRITE, RDMA_READ, FETCH_ADD, COMP_SWAP
    assert res["read_ok"] and res["guest_written_ok"]
    assert (res["faa_orig"], res["cas_orig"], res["guest_word"]) == (100, 105, 999)
