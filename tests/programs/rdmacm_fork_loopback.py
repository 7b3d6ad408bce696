"""rdma_cm between two forked processes on one loopback address, as rdma-core's rdma_cm
tests run: the parent opens the default device (so it holds its address), then forks a
passive side that binds and listens on that address and an active side that connects to
it from it. Prints "fork loopback ok" when both sides reach ESTABLISHED and a SEND
crosses. Usage: prog.py PORT"""
import multiprocessing as mp
import sys

from softrdma.rdmacm import (CMEventChannel, CMEvent, CMID, AddrInfo, ConnParam, RAI_PASSIVE,
                             RDMA_PS_TCP, rdma_cm_event_type as E)
from softrdma.verbs_api import Context, QPCap, QPInitAttr, get_soft_device
from softrdma.verbs_api.enums import ibv_qp_type

port = sys.argv[1]
ctx = Context(name="softrdma0")  # held open: the parent keeps its device and address
ip = get_soft_device("softrdma0").ip


def expect(ch, want):
    ev = CMEvent(ch, timeout=10)
    assert ev.event_type == want, (ev, want)
    return ev


def init():
    return QPInitAttr(qp_type=ibv_qp_type.IBV_QPT_RC, cap=QPCap(max_recv_wr=2, max_send_wr=2))


def passive(q, barrier):
    ch = CMEventChannel()
    lid = CMID(ch)
    lid.bind_addr(AddrInfo(src=ip, src_service=port, port_space=RDMA_PS_TCP,
                           flags=RAI_PASSIVE))
    lid.listen()
    barrier.wait()
    ev = expect(ch, E.RDMA_CM_EVENT_CONNECT_REQUEST)
    cid = CMID(ev, listen_id=lid)
    cid.create_qp(init())
    mr = cid.reg_msgs(64)
    cid.post_recv(mr, 64)
    cid.accept(ConnParam())
    expect(ch, E.RDMA_CM_EVENT_ESTABLISHED)
    wc = cid.get_recv_comp(timeout=10)
    q.put(("passive", get_soft_device("softrdma0").ip, bytes(mr.mem[:5]), wc.status))
    expect(ch, E.RDMA_CM_EVENT_DISCONNECTED)
    cid.close()
    lid.close()


def active(q, barrier):
    ch = CMEventChannel()
    cid = CMID(ch)
    cid.resolve_addr(AddrInfo(src=ip, dst=ip, dst_service=port, port_space=RDMA_PS_TCP))
    expect(ch, E.RDMA_CM_EVENT_ADDR_RESOLVED)
    barrier.wait()
    cid.resolve_route()
    expect(ch, E.RDMA_CM_EVENT_ROUTE_RESOLVED)
    cid.create_qp(init())
    cid.connect(ConnParam())
    expect(ch, E.RDMA_CM_EVENT_ESTABLISHED)
    mr = cid.reg_msgs(64)
    mr.mem[:5] = b"hello"
    cid.post_send(mr, length=5)
    wc = cid.get_send_comp(timeout=10)
    q.put(("active", get_soft_device("softrdma0").ip, None, wc.status))
    cid.disconnect()


c = mp.get_context("fork")
q, barrier = c.Queue(), c.Barrier(2, timeout=15)
procs = [c.Process(target=passive, args=(q, barrier)), c.Process(target=active, args=(q, barrier))]
for p in procs:
    p.start()
for p in procs:
    p.join(30)
codes = [p.exitcode for p in procs]
got = {}
while not q.empty():
    side, dev_ip, data, status = q.get()
    got[side] = (dev_ip, data, status)
assert codes == [0, 0], (codes, got)
assert got["passive"][1:] == (b"hello", 0) and got["active"][2] == 0, got
# each child's device is its own, on an address of its own, not the parent's
assert len({ip, got["passive"][0], got["active"][0]}) == 3, (ip, got)
print("fork loopback ok", ip, got["passive"][0], got["active"][0])
