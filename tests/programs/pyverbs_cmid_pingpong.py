"""An unchanged-pyverbs rdma_cm program: a synchronous listener (CMID(AddrInfo passive),
get_request, accept) on a thread, an active CMID(AddrInfo) that connects, MRs from
reg_msgs and MR(cmid, ...), one SEND each way, RDMA WRITE, disconnect. Prints
"cmid ok" on success. Usage: prog.py IP|auto PORT ("auto": the device's address found as
rdma-core's tests/base.py finds it: sysfs net directory, then ``ip -j addr show``; needs
SOFTRDMA_NETDEV=1 under softrdma run)."""
import json
import os
import subprocess
import sys
import threading

import pyverbs.cm_enums as ce
import pyverbs.enums as e
from pyverbs.cmid import CMID, AddrInfo, ConnParam
from pyverbs.mr import MR
from pyverbs.qp import QPCap, QPInitAttr

ip, port = sys.argv[1], sys.argv[2]
if ip == "auto":
    import pyverbs.device as d
    ctx = d.Context(name="softrdma0")
    net = "/sys/class/infiniband/softrdma0/device/net/"
    assert os.path.exists(net), "no net interface"
    ifname = subprocess.check_output(["ls", net]).decode().split("\n")[0]
    info = json.loads(subprocess.check_output(["ip", "-j", "addr", "show", ifname]).decode())
    ip = info[0]["addr_info"][0]["local"]
    print("address", ifname, ip, info[0]["address"])
init = QPInitAttr(qp_type=e.IBV_QPT_RC, cap=QPCap(max_recv_wr=2))
got = {}


def server():
    lid = CMID(creator=AddrInfo(src=ip, src_service=port, port_space=ce.RDMA_PS_TCP,
                                flags=ce.RAI_PASSIVE), qp_init_attr=init)
    lid.listen()
    ready.set()
    cid = lid.get_request()
    mr = cid.reg_msgs(64)
    wmr = MR(cid, 64, e.IBV_ACCESS_REMOTE_WRITE)
    got["wmr"] = (wmr.rkey, wmr.buf)
    cid.post_recv(mr, 64)
    cid.accept(ConnParam())
    wc = cid.get_recv_comp()
    got["srv_recv"] = (wc.status, mr.read(5, 0))
    mr.write(b"pong!", 5)
    cid.post_send(mr, length=5)
    got["srv_send"] = cid.get_send_comp().status
    got["written"] = wmr
    done.wait(30)
    got["srv_written"] = wmr.read(6, 0)
    cid.close()
    lid.close()


ready, done = threading.Event(), threading.Event()
t = threading.Thread(target=server, daemon=True)
t.start()
assert ready.wait(10)
cid = CMID(creator=AddrInfo(src=ip, dst=ip, dst_service=port, port_space=ce.RDMA_PS_TCP),
           qp_init_attr=init)
mr = cid.reg_msgs(64)
assert type(mr) is MR, type(mr)
cid.post_recv(mr, 64)
cid.connect(ConnParam())
mr.write(b"ping!", 5)
cid.post_send(mr, length=5)
assert cid.get_send_comp().status == e.IBV_WC_SUCCESS
wc = cid.get_recv_comp()
assert wc.status == e.IBV_WC_SUCCESS and mr.read(5, 0) == b"pong!", (wc, mr.read(5, 0))
rkey, addr = got["wmr"]
mr.write(b"write!", 6)
cid.post_write(mr, 6, addr, rkey, flags=e.IBV_SEND_SIGNALED)
assert cid.get_send_comp().status == e.IBV_WC_SUCCESS
done.set()
t.join(30)
assert got["srv_recv"] == (e.IBV_WC_SUCCESS, b"ping!"), got
assert got["srv_written"] == b"write!", got
try:
    MR(cid, 64, e.IBV_ACCESS_REMOTE_ATOMIC)
except Exception as ex:  # pyverbs: only the three reg_* flags
    assert getattr(ex, "error_code", None) == 22, ex
else:
    raise AssertionError("MR(cmid, REMOTE_ATOMIC) was made")
cid.disconnect()
cid.close()
print("cmid ok")
