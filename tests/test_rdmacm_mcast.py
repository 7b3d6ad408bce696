"""rdma_cm multicast (softrdma.rdmacm ``join_multicast``/``leave_multicast``), held to the
kernel's RoCEv2 join (cma.c ``cma_iboe_join_multicast`` and ``cma_make_mc_event``) and
librdmacm (``ucma_process_join`` attaches the id's QP; ``rdma_leave_multicast`` detaches
it; a send-only full member's QP is not attached; leaving a group not joined is
EADDRNOTAVAIL). Live devices on 127.0.3.4x, groups 239.3.1.x."""

from __future__ import annotations

import errno
import time

import pytest

from softrdma.errors import PyverbsRDMAError
from softrdma.rdmacm import AddrInfo, CMEvent, CMEventChannel, CMID, RDMA_PS_UDP, UDParam
from softrdma.rdmacm import enums as ce
from softrdma.verbs_api import AH, QPCap, QPInitAttr, add_device, remove_device
from softrdma.verbs_api.enums import ibv_qp_type, ibv_wc_status

A_IP, B_IP = "127.0.3.41", "127.0.3.42"
E = ce.rdma_cm_event_type
GRH = 40
# librdmacm/cma.h and the kernel's values, written out (not read from softrdma)
RDMA_UDP_QKEY = 0x01234567
MULTICAST_QPN = 0xFFFFFF
IPV6_DEFAULT_HOPLIMIT = 64
ENOTSUPP = 524


@pytest.fixture
def devices():
    a = add_device(A_IP, name="rcm3-a")
    b = add_device(B_IP, name="rcm3-b")
    try:
        yield a, b
    finally:
        for name in ("rcm3-a", "rcm3-b"):
            for _ in range(50):
                try:
                    remove_device(name)
                    break
                except PyverbsRDMAError:
                    time.sleep(0.02)


def expect(ch: CMEventChannel, want: int, timeout: float = 5.0) -> CMEvent:
    ev = CMEvent(ch, timeout)
    assert ev.event_type == want, (ev.event_str(), ev.status)
    return ev


def ud_id(ip: str, group: str) -> tuple[CMEventChannel, CMID]:
    """A UDP-port-space id resolved from ``ip`` towards the group, with a UD QP (mckey's
    and rdma-core's tests' order: bind, resolve_addr, create_qp, then join)."""
    ch = CMEventChannel()
    cid = CMID(ch, port_space=RDMA_PS_UDP)
    cid.resolve_addr(AddrInfo(src=ip, dst=group, port_space=RDMA_PS_UDP))
    expect(ch, E.RDMA_CM_EVENT_ADDR_RESOLVED)
    cid.create_qp(QPInitAttr(qp_type=ibv_qp_type.IBV_QPT_UD,
                             cap=QPCap(max_send_wr=8, max_recv_wr=8)))
    return ch, cid


def test_join_event_carries_the_kernels_ud_parameters(devices):
    """MULTICAST_JOIN: qp_num 0xFFFFFF, qkey RDMA_UDP_QKEY, an AH whose dgid is the group
    as an IPv4-mapped GID, hop limit 64 (IPV6_DEFAULT_HOPLIMIT for an IPv4 group on
    RoCEv2), dlid 0 and sl 0 (mckey prints ``mlid 0x0 sl 0`` on rxe), the source GID
    index the id's address has; the join's context comes back in the event."""
    a, b = devices
    ch, cid = ud_id(A_IP, "239.3.1.1")
    try:
        cid.join_multicast("239.3.1.1", context="ctx")
        ev = expect(ch, E.RDMA_CM_EVENT_MULTICAST_JOIN)
        assert ev.status == 0
        ud = UDParam(ev)
        assert ud.qp_num == MULTICAST_QPN and ud.qkey == RDMA_UDP_QKEY
        ah = ud.ah_attr
        assert ah.is_global == 1 and ah.dlid == 0 and ah.sl == 0
        assert bytes(ah.gr.dgid.raw) == bytes(10) + b"\xff\xff" + bytes([239, 3, 1, 1])
        assert ah.gr.hop_limit == IPV6_DEFAULT_HOPLIMIT
        assert a.gid_table[ah.gr.sgid_index] == bytes(10) + b"\xff\xff" + bytes([127, 0, 3, 41])
        assert ev._ev.ud.context == "ctx"
        # ucma_process_join: the id's QP is attached to the group
        assert cid.qp.qp_num in [q.qp_num for q in a.mcast.group(bytes([239, 3, 1, 1])).qps]
        cid.leave_multicast("239.3.1.1")
        assert a.mcast.group(bytes([239, 3, 1, 1])) is None
    finally:
        cid.close()


def test_join_then_send_reaches_the_other_member_and_leave_stops_it(devices):
    """Two ids on two devices join 239.3.1.2; a UD send to the event's AH, QPN and Q_Key
    reaches the other id's QP; after it leaves, another send does not."""
    a, b = devices
    sch, sender = ud_id(A_IP, "239.3.1.2")
    rch, receiver = ud_id(B_IP, "239.3.1.2")
    try:
        sender.join_multicast("239.3.1.2")
        params = UDParam(expect(sch, E.RDMA_CM_EVENT_MULTICAST_JOIN))
        receiver.join_multicast("239.3.1.2")
        expect(rch, E.RDMA_CM_EVENT_MULTICAST_JOIN)
        smr, rmr = sender.reg_msgs(256), receiver.reg_msgs(256)
        receiver.post_recv(rmr, 64 + GRH)
        smr.write(b"m" * 64, 64)
        ah = AH(sender.pd, attr=params.ah_attr)
        sender.post_ud_send(smr, ah, rqpn=params.qp_num, length=64)
        assert sender.get_send_comp(5).status == ibv_wc_status.IBV_WC_SUCCESS
        wc = receiver.get_recv_comp(5)
        assert wc.status == ibv_wc_status.IBV_WC_SUCCESS and wc.byte_len == 64 + GRH
        assert rmr.read(64, GRH) == b"m" * 64
        receiver.leave_multicast("239.3.1.2")
        receiver.post_recv(rmr, 64 + GRH)
        sender.post_ud_send(smr, ah, rqpn=params.qp_num, length=64)
        sender.get_send_comp(5)
        assert receiver.get_recv_comp(0.3) is None  # nothing within the wait
    finally:
        sender.close()
        receiver.close()


def test_send_only_join_does_not_attach(devices):
    """RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER (1): the event comes, the QP stays out of the
    group (librdmacm attaches only full members)."""
    a, b = devices
    ch, cid = ud_id(A_IP, "239.3.1.3")
    try:
        cid.join_multicast("239.3.1.3", join_flags=1)
        expect(ch, E.RDMA_CM_EVENT_MULTICAST_JOIN)
        assert a.mcast.group(bytes([239, 3, 1, 3])) is None
        cid.leave_multicast("239.3.1.3")
    finally:
        cid.close()


def test_join_errors(devices):
    """A unicast address is EINVAL; an id with no device yet (not bound, not resolved) is
    EINVAL (rdma_join_multicast's state check); leaving a group never joined is
    EADDRNOTAVAIL (librdmacm); an IPv6 group fails at once with ENOTSUPP (524:
    cma_iboe_join_multicast refuses it on RoCEv2, so rdma_join_multicast returns -1)."""
    a, b = devices
    ch, cid = ud_id(A_IP, "239.3.1.4")
    fresh = CMID(CMEventChannel(), port_space=RDMA_PS_UDP)
    try:
        with pytest.raises(PyverbsRDMAError) as e:
            cid.join_multicast("10.1.2.3")
        assert e.value.error_code == errno.EINVAL
        with pytest.raises(PyverbsRDMAError) as e:
            fresh.join_multicast("239.3.1.4")
        assert e.value.error_code == errno.EINVAL
        with pytest.raises(PyverbsRDMAError) as e:
            cid.leave_multicast("239.3.1.5")
        assert e.value.error_code == errno.EADDRNOTAVAIL
        with pytest.raises(PyverbsRDMAError) as e:
            cid.join_multicast("ff15::3:1")
        assert e.value.error_code == ENOTSUPP
        assert ch.pending() is False  # no event either
    finally:
        cid.close()
        fresh.close()
