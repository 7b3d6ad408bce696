"""An rdma_cm connection rejected with private data, either end, in librdmacm's event
style. Written once against the pyverbs.cmid API, so it runs on softrdma.rdmacm (the
default) and, with --pyverbs, on the real pyverbs over real librdmacm and kernel rxe (the
lab's guests have python3-pyverbs).

    rdmacm_reject.py [--pyverbs] server ADDR PORT REJ_DATA
        listen on ADDR:PORT (TCP port space); print the CONNECT_REQUEST's private data
        ("request data: HEX"), reject it with REJ_DATA, print "rejected"
    rdmacm_reject.py [--pyverbs] client ADDR PORT REQ_DATA
        connect to ADDR:PORT with REQ_DATA as the REQ's private data; print the event that
        answers ("event: NAME"), its status where the API has it ("status: N"; pyverbs 44
        has none) and its private data ("private data: HEX")

Exit 0 when the steps went as described; the test compares what was printed. Each wait
for an event is bounded (softrdma) or the program runs under `timeout` (pyverbs).
"""

from __future__ import annotations

import sys

argv = sys.argv[1:]
if argv and argv[0] == "--pyverbs":
    argv = argv[1:]
    import pyverbs.cm_enums as ce
    import pyverbs.enums as ve
    from pyverbs.cmid import CMID, AddrInfo, CMEvent, CMEventChannel, ConnParam
    from pyverbs.qp import QPCap, QPInitAttr

    def get_event(ch):
        return CMEvent(ch)
else:
    import softrdma.rdmacm as ce
    import softrdma.verbs_api.enums as ve
    from softrdma.rdmacm import CMID, AddrInfo, CMEvent, CMEventChannel, ConnParam
    from softrdma.verbs_api import QPCap, QPInitAttr

    def get_event(ch):
        return CMEvent(ch, 60.0)


def expect(ch, want):
    ev = get_event(ch)
    name = ev.event_str()
    if ev.event_type != want:
        print(f"unexpected event: {name}", flush=True)
        sys.exit(1)
    return ev


def server(addr: str, port: str, data: bytes) -> int:
    ch = CMEventChannel()
    lid = CMID(ch, port_space=ce.RDMA_PS_TCP)
    lid.bind_addr(AddrInfo(src=addr, src_service=port, port_space=ce.RDMA_PS_TCP,
                           flags=ce.RAI_PASSIVE))
    lid.listen(1)
    print("listening", flush=True)
    ev = expect(ch, ce.RDMA_CM_EVENT_CONNECT_REQUEST)
    print(f"request data: {ev.private_data.hex()}", flush=True)
    req = CMID(ev, listen_id=lid)
    ev.ack_cm_event()
    req.reject(data)
    print("rejected", flush=True)
    req.close()
    lid.close()
    ch.close()
    return 0


def client(addr: str, port: str, data: bytes) -> int:
    ch = CMEventChannel()
    cid = CMID(ch, port_space=ce.RDMA_PS_TCP)
    cid.resolve_addr(AddrInfo(dst=addr, dst_service=port, port_space=ce.RDMA_PS_TCP), 2000)
    expect(ch, ce.RDMA_CM_EVENT_ADDR_RESOLVED).ack_cm_event()
    cid.resolve_route(2000)
    expect(ch, ce.RDMA_CM_EVENT_ROUTE_RESOLVED).ack_cm_event()
    cid.create_qp(QPInitAttr(qp_type=ve.IBV_QPT_RC, cap=QPCap(max_send_wr=1, max_recv_wr=1)))
    param = ConnParam(data_len=len(data))
    param.set_private_data(data)
    cid.connect(param)
    ev = get_event(ch)
    print(f"event: {ev.event_str()}", flush=True)
    if hasattr(ev, "status"):
        print(f"status: {ev.status}", flush=True)
    print(f"private data: {ev.private_data.hex()}", flush=True)
    ev.ack_cm_event()
    cid.close()
    ch.close()
    return 0


def main() -> int:
    role, addr, port, data = argv
    return (server if role == "server" else client)(addr, port, data.encode())


if __name__ == "__main__":
    sys.exit(main())
