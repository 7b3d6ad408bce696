"""``post_recv`` of one plain WR (softrdma.verbs_api.soft_qp ``_post_recv_one``): the
latency loop's repost (perftest's ib_send_lat reposts before its next SEND) queues the
same WQE as the general path, without its per-WR checks by name; every WR it does not
take, and every error, goes to the general path, which reports it as before."""

from __future__ import annotations

import errno

import pytest

from softrdma.errors import PyverbsRDMAError
from softrdma.enums import IBV_WR_SEND
from softrdma.harness.testing import connected_pair
from softrdma.sim import SimNetwork
from softrdma.verbs_api import QPAttr, RecvWR, SGE, soft_qp
from softrdma.verbs_api.enums import ibv_qp_state


def _pair():
    net = SimNetwork()
    a, b = connected_pair(net, "RC")
    return net, a, b


def test_a_plain_wr_takes_the_one_wr_path_and_its_data_lands(monkeypatch):
    net, a, b = _pair()

    def general(*args, **kw):  # the general path's WQE maker: not called for a plain WR
        raise AssertionError("the general path ran")
    monkeypatch.setattr(soft_qp, "recv_wqe", general)
    b.qp.post_recv(RecvWR(0x1234, 1, [SGE(b.mr.buf + 100, 64, b.mr.lkey)]))
    a.mr.write(b"to the fast repost", 18)
    a.post_send(IBV_WR_SEND, a.sge(0, 18), 1)
    net.run()
    wcs = b.cq.poll_all()
    assert [(w.wr_id, w.byte_len, w.status) for w in wcs] == [(0x1234, 18, 0)]
    assert b.mr.read(18, 100) == b"to the fast repost"


@pytest.mark.parametrize("wr", [
    RecvWR(-1, 1, [SGE(0x1000, 64, 1)]),  # wr_id out of range
    RecvWR(1, 1, [SGE(0x1000, 1 << 32, 1)]),  # length over 32 bits
    RecvWR(1, 1, [SGE(0x1000, 64, -5)]),  # a negative lkey
    RecvWR(1, 2, [SGE(0x1000, 64, 1)]),  # num_sge beyond the list
], ids=["wr_id", "length", "lkey", "num_sge"])
def test_what_it_does_not_take_is_refused_by_name(wr):
    net, a, b = _pair()
    with pytest.raises(PyverbsRDMAError) as e:
        b.qp.post_recv(wr)
    assert e.value.error_code == errno.EINVAL
    assert "Failed to post receive" in str(e.value) and "wr[0]" in str(e.value)


def test_reset_full_and_err_states_as_the_general_path():
    net, a, b = _pair()
    n = 0
    with pytest.raises(PyverbsRDMAError) as e:  # fill the RQ: the next one is ENOMEM
        while True:
            b.qp.post_recv(RecvWR(n, 1, [SGE(b.mr.buf, 64, b.mr.lkey)]))
            n += 1
    assert e.value.error_code == errno.ENOMEM and n > 0
    b.qp.modify(QPAttr(qp_state=ibv_qp_state.IBV_QPS_ERR), 1)
    b.cq.poll_all()
    b.qp.post_recv(RecvWR(99, 1, [SGE(b.mr.buf, 64, b.mr.lkey)]))  # in ERR: flushed at once
    assert [(w.wr_id, w.status) for w in b.cq.poll_all()] == [(99, 5)]  # IBV_WC_WR_FLUSH_ERR
    b.qp.modify(QPAttr(qp_state=ibv_qp_state.IBV_QPS_RESET), 1)
    with pytest.raises(PyverbsRDMAError) as e:
        b.qp.post_recv(RecvWR(1, 1, [SGE(b.mr.buf, 64, b.mr.lkey)]))
    assert e.value.error_code == errno.EINVAL and "RESET" in str(e.value)
