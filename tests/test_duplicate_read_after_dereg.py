"""A duplicated RDMA READ request that arrives after the MR it read from was
deregistered (found by the socket layer's model test under duplication): rxe re-reads
from its saved responder resource, finds the rkey gone and answers NAK remote access
error, moving the QP to ERR (rxe_resp.c: read_reply -> RESPST_ERR_RKEY_VIOLATION, a
class C error). softrdma must do the same, not fault on an unexpected exception."""

from __future__ import annotations

from softrdma.harness.sim import SimNetwork
from softrdma.harness.testing import connected_pair
from softrdma.verbs_api import MR, SendWR
from softrdma.verbs_api.enums import (
    IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_READ, IBV_QPS_ERR, IBV_WR_RDMA_READ,
)
from softrdma.wire.packet import parse


def test_duplicate_read_after_the_mr_is_gone_naks_and_errors_the_qp_cleanly():
    with SimNetwork(seed=3) as net:
        a, b = connected_pair(net)
        src = MR(b.pd, 64, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ)
        src.write(b"r" * 64, 64)
        seen = []  # what b's device receives, to replay a READ request later
        real_receive = b.device.receive

        def tap(data, *args, **kw):
            seen.append((bytes(data), args, kw))
            return real_receive(data, *args, **kw)
        b.device.receive = tap
        wr = SendWR(1, IBV_WR_RDMA_READ, 1, sg=[a.sge(0, 64)])
        wr.set_wr_rdma(src.rkey, src.buf)
        a.qp.post_send(wr)
        assert net.run_until(lambda: a.cq.poll(1)[0] or False, 5)
        assert a.mr.read(64, 0) == b"r" * 64
        src.close()  # the owner frees the buffer once the reader is done
        read_req = next(s for s in seen if parse(s[0]).name == "RC_RDMA_READ_REQUEST")
        sent_before = net.stats["sent"]
        tap(read_req[0], *read_req[1], **read_req[2])  # the network delivers it again
        assert b.device.counters.qp_fatal == 0  # no unexpected exception in the engine
        assert b.qp.state == IBV_QPS_ERR  # class C: the responder's QP goes to ERR
        net.run()
        assert net.stats["sent"] > sent_before  # a NAK went out
        b.device.receive = real_receive
