"""The path's traffic class reaches the IP header: rxe sends every packet with the IPv4 TOS
(IPv6 traffic class) of its address vector (``prepare4``/``prepare6`` in rxe_net.c take
``av->grh.traffic_class``): a UD send the AH's, an RC QP's requests and ACKs the primary
path's (rdma_cm's RDMA_OPTION_ID_TOS ends up there). softrdma sent 0.

The peer here is a plain UDP socket on 127.0.9.2:4791 that asks the kernel for each
datagram's TOS (IP_RECVTOS), so what is checked is what the kernel put on the wire.
"""

from __future__ import annotations

import socket
import time

import pytest

from softrdma.verbs_api import (
    AH, AHAttr, CQ, GID, MR, PD, QP, QPAttr, QPCap, QPInitAttr, SGE, RecvWR, SendWR, Context,
    GlobalRoute,
)
from softrdma.verbs_api.device import add_device, unregister_device

ME, PEER = "127.0.9.1", "127.0.9.2"
UD, RC = 4, 2
IP_RECVTOS = 13  # linux/in.h


@pytest.fixture
def peer():
    """A UDP socket standing in for the remote device: it returns (TOS, datagram)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IP, IP_RECVTOS, 1)
    s.bind((PEER, 4791))
    s.settimeout(10)

    def recv() -> tuple[int, bytes]:
        data, anc, _flags, _addr = s.recvmsg(4096, 64)
        tos = [c[2][0] for c in anc if c[0] == socket.IPPROTO_IP and c[1] == socket.IP_TOS]
        assert len(tos) == 1, anc
        return tos[0], data

    yield recv
    s.close()


@pytest.fixture
def ctx():
    dev = add_device(ME, name="softrdma-tos")
    dev.attach_udp()
    with Context(name="softrdma-tos") as c:
        yield c
    dev.detach()
    unregister_device("softrdma-tos")


def _peer_gid() -> str:
    return f"::ffff:{PEER}"


def _av(tclass: int) -> AHAttr:
    return AHAttr(is_global=1, port_num=1,
                  gr=GlobalRoute(dgid=GID(_peer_gid()), sgid_index=1, traffic_class=tclass))


def _objects(ctx, qpt: int):
    pd = PD(ctx)
    cq = CQ(ctx, 16, None, None, 0)
    qp = QP(pd, QPInitAttr(qp_type=qpt, scq=cq, rcq=cq,
                           cap=QPCap(max_send_wr=4, max_recv_wr=4, max_send_sge=1,
                                     max_recv_sge=1)))
    mr = MR(pd, 8192, 1)
    return pd, cq, qp, mr


@pytest.mark.parametrize("tclass", [0, 0x68, 0xB8])
def test_ud_send_carries_the_ah_traffic_class(ctx, peer, tclass):
    """A UD SEND to an AH with traffic class T leaves with IPv4 TOS T (0 stays 0)."""
    pd, cq, qp, mr = _objects(ctx, UD)
    qp.to_rts(QPAttr(qkey=0x11111111))
    ah = AH(pd, attr=_av(tclass))
    wr = SendWR(wr_id=1, sg=[SGE(mr.buf, 16, mr.lkey)])
    wr.set_wr_ud(ah, 0x123, 0x11111111)
    qp.post_send(wr)
    tos, data = peer()
    assert data[0] == 0x64  # BTH opcode: UD SEND ONLY
    assert tos == tclass


def test_rc_requests_carry_the_primary_path_traffic_class(ctx, peer):
    """An RC QP's requests leave with its primary path's traffic class, also when they
    leave as one UDP GSO train (a 4 KiB SEND at MTU 1024: FIRST, then a train of three)."""
    pd, cq, qp, mr = _objects(ctx, RC)
    a = QPAttr(qp_state=1, pkey_index=0, port_num=1, qp_access_flags=7)
    qp.modify(a, 1 | 16 | 32 | 8)  # STATE | PKEY_INDEX | PORT | ACCESS_FLAGS
    a = QPAttr(qp_state=3 - 1 + 0)  # RTR
    a.qp_state, a.ah_attr, a.path_mtu, a.dest_qp_num = 2, _av(0x2E), 3, 0x77
    a.rq_psn, a.max_dest_rd_atomic, a.min_rnr_timer = 0, 1, 12
    qp.modify(a, 1 | 128 | 256 | (1 << 20) | (1 << 12) | (1 << 17) | (1 << 15))
    a = QPAttr(qp_state=3, sq_psn=0, timeout=14, retry_cnt=7, rnr_retry=7, max_rd_atomic=1)
    qp.modify(a, 1 | (1 << 16) | (1 << 9) | (1 << 10) | (1 << 11) | (1 << 13))
    qp.post_send(SendWR(wr_id=1, sg=[SGE(mr.buf, 16, mr.lkey)]))
    tos, data = peer()
    assert data[0] == 0x04  # BTH opcode: RC SEND ONLY
    assert tos == 0x2E
    qp.post_send(SendWR(wr_id=2, sg=[SGE(mr.buf, 4096, mr.lkey)]))
    got = [peer() for _ in range(4)]
    assert [d[0] for _, d in got] == [0x00, 0x01, 0x01, 0x02]  # SEND FIRST, MIDDLE x2, LAST
    assert [t for t, _ in got] == [0x2E] * 4


def test_ud_receive_grh_shows_the_tos_that_arrived(ctx):
    """Across real UDP (127.0.9.1 -> 127.0.9.3), a UD receive's GRH area holds the IPv4
    header as the packet arrived, TOS included, as rxe copies the real header: softrdma
    asks the kernel for it (IP_RECVTOS), a UDP socket having no other way to see it."""
    other = add_device("127.0.9.3", name="softrdma-tos2")
    other.attach_udp()
    try:
        with Context(name="softrdma-tos2") as c2:
            pd2 = PD(c2)
            cq2 = CQ(c2, 16, None, None, 0)
            rqp = QP(pd2, QPInitAttr(qp_type=UD, scq=cq2, rcq=cq2,
                                     cap=QPCap(max_send_wr=4, max_recv_wr=4, max_send_sge=1,
                                               max_recv_sge=1)))
            rqp.to_rts(QPAttr(qkey=0x11111111))
            rmr = MR(pd2, 256, 1)
            rqp.post_recv(RecvWR(wr_id=7, sg=[SGE(rmr.buf, 256, rmr.lkey)]))
            pd, cq, qp, mr = _objects(ctx, UD)
            qp.to_rts(QPAttr(qkey=0x11111111))
            ah = AH(pd, attr=AHAttr(is_global=1, port_num=1, gr=GlobalRoute(
                dgid=GID("::ffff:127.0.9.3"), sgid_index=1, traffic_class=0x88)))
            wr = SendWR(wr_id=1, sg=[SGE(mr.buf, 16, mr.lkey)])
            wr.set_wr_ud(ah, rqp.qp_num, 0x11111111)
            qp.post_send(wr)
            deadline = time.monotonic() + 10
            wcs = []
            while not wcs and time.monotonic() < deadline:
                wcs = cq2.poll_all()
                time.sleep(0.01)
            assert [w.status for w in wcs] == [0]
            ip = bytes(rmr.read(20, 20))  # the GRH area's last 20 bytes: the IPv4 header
            assert ip[0] == 0x45 and ip[12:16] == bytes([127, 0, 9, 1])
            assert ip[1] == 0x88  # the TOS the sender's AH gave it
    finally:
        other.detach()
        unregister_device("softrdma-tos2")
