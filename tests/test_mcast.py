"""UD multicast groups (softrdma.soft.mcast), held to Linux rxe (rxe_mcast.c, rxe_recv.c's
rxe_rcv_mcast_pkt) and the verbs core (ib_attach_mcast).

Two live devices on this host's loopback (127.0.3.x; lo carries IPv4 multicast: a socket
bound to the group's address that joined it on lo gets what a socket bound to a lo
address sends there), groups 239.3.x.x only. Each packet sent to a group leaves through
a real UDP socket and comes back through the group's socket, as it would from the wire.
"""

from __future__ import annotations

import errno
import ipaddress

import pytest

from softrdma.errors import PyverbsRDMAError
from softrdma.verbs_api import (
    AH, AHAttr, CQ, GID, MR, PD, QP, Context, GlobalRoute, QPAttr, QPCap, QPInitAttr, RecvWR,
    SGE, SendWR, add_device, remove_device,
)
from softrdma.verbs_api.enums import (
    IBV_ACCESS_LOCAL_WRITE, IBV_QPT_RC, IBV_QPT_UD, IBV_SEND_SIGNALED, IBV_WC_RECV,
    IBV_WC_SUCCESS, IBV_WR_SEND,
)

from .conftest import wait_until

QKEY = 0x11223344
MCAST_QPN = 0xFFFFFF  # IB_MULTICAST_QPN
GRH = 40


class Side:
    """A context, PD, CQ, MR and one UD QP in RTS with Q_Key ``qkey`` on device ``name``."""

    def __init__(self, name: str, qkey: int = QKEY, qpt: int = IBV_QPT_UD) -> None:
        self.ctx = Context(name=name)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 64, None, None, 0)
        self.qp = QP(self.pd, QPInitAttr(qp_type=qpt, scq=self.cq, rcq=self.cq, cap=QPCap(
            max_send_wr=16, max_recv_wr=16, max_send_sge=1, max_recv_sge=1)))
        if qpt == IBV_QPT_UD:
            self.qp.to_rts(QPAttr(qkey=qkey, port_num=1))
        self.mr = MR(self.pd, 4096, IBV_ACCESS_LOCAL_WRITE)

    def post_recvs(self, n: int = 4) -> None:
        for i in range(n):
            self.qp.post_recv(RecvWR(wr_id=i, num_sge=1, sg=[SGE(self.mr.buf + 512 * i, 512,
                                                                   self.mr.lkey)]))

    def send(self, group: GID, data: bytes, qkey: int = QKEY) -> None:
        ah = AH(self.pd, attr=AHAttr(is_global=1, port_num=1,
                                     gr=GlobalRoute(dgid=group, sgid_index=1, hop_limit=64)))
        self.mr.write(data, len(data), 2048)
        wr = SendWR(wr_id=99, opcode=IBV_WR_SEND, num_sge=1,
                    sg=[SGE(self.mr.buf + 2048, len(data), self.mr.lkey)],
                    send_flags=IBV_SEND_SIGNALED)
        wr.set_wr_ud(ah, MCAST_QPN, qkey)
        self.qp.post_send(wr)
        wcs = self.poll(1)
        assert [w.status for w in wcs] == [IBV_WC_SUCCESS]

    def poll(self, n: int, timeout: float = 5.0) -> list:
        got: list = []

        def more() -> bool:
            _, wcs = self.cq.poll(n - len(got))
            got.extend(wcs)
            return len(got) >= n
        wait_until(more, timeout)
        return got

    def close(self) -> None:
        self.ctx.close()


@pytest.fixture
def devices():
    """Two live devices, 127.0.3.31 and .32 (names mc3x, mc3y)."""
    a = add_device("127.0.3.31", name="mc3x")
    b = add_device("127.0.3.32", name="mc3y")
    made: list[Side] = []

    def side(name: str, **kw) -> Side:
        s = Side(name, **kw)
        made.append(s)
        return s
    yield a, b, side
    for s in made:
        s.close()
    remove_device("mc3x")
    remove_device("mc3y")


def test_every_attached_qp_of_every_device_gets_its_own_copy(devices):
    """A send to 239.3.0.1 (QPN 0xFFFFFF) reaches each attached QP, two on the other device
    and one on the sender's (rxe loops a group's packets back to the host's members), each
    with the payload after the 40-byte GRH area, the IPv4 header naming the group."""
    a, b, side = devices
    s, r1, r2, r3 = side("mc3x"), side("mc3y"), side("mc3y"), side("mc3x")
    group = GID("::ffff:239.3.0.1")
    for r in (r1, r2, r3):
        r.qp.attach_mcast(group)
        r.post_recvs(1)
    s.send(group, b"to-the-group")
    for r in (r1, r2, r3):
        wcs = r.poll(1)
        assert [(w.status, w.opcode, w.byte_len, w.src_qp) for w in wcs] == \
            [(IBV_WC_SUCCESS, IBV_WC_RECV, GRH + 12, s.qp.qp_num)]
        assert r.mr.read(12, GRH) == b"to-the-group"
        ip = r.mr.read(20, 20)  # IPv4: the header in the GRH area's last 20 bytes
        assert ip[0] == 0x45 and ip[16:20] == ipaddress.ip_address("239.3.0.1").packed
        assert ip[12:16] == ipaddress.ip_address("127.0.3.31").packed


def test_detach_stops_delivery_and_the_last_detach_leaves_the_group(devices):
    """After detach, the QP gets nothing; the device's group (and its socket) goes with
    the last attached QP (rxe_mcast_del)."""
    a, b, side = devices
    s, r1, r2 = side("mc3x"), side("mc3y"), side("mc3y")
    group = GID("::ffff:239.3.0.2")
    r1.qp.attach_mcast(group)
    r2.qp.attach_mcast(group)
    r1.post_recvs(2)
    r2.post_recvs(2)
    r1.qp.detach_mcast(group)
    s.send(group, b"one")
    assert len(r2.poll(1)) == 1
    assert r1.poll(1, timeout=0.3) == []
    assert b.mcast.group(bytes([239, 3, 0, 2])) is not None
    r2.qp.detach_mcast(group)
    assert b.mcast.group(bytes([239, 3, 0, 2])) is None
    assert bytes([239, 3, 0, 2]) not in b.udp.groups
    s.send(group, b"two")
    assert r2.poll(1, timeout=0.3) == []  # nothing joined: the datagram never arrives


def test_qkey_mismatch_is_dropped_for_that_qp_only_and_counted(devices):
    """rxe_rcv_mcast_pkt checks each QP's Q_Key (check_keys): a QP whose Q_Key differs
    gets nothing, the drop is counted, the others still get their copy."""
    a, b, side = devices
    s, good, other = side("mc3x"), side("mc3y"), side("mc3y", qkey=0x999)
    group = GID("::ffff:239.3.0.3")
    for r in (good, other):
        r.qp.attach_mcast(group)
        r.post_recvs(1)
    before = b.counters.drops.get("qkey_violation", 0)
    s.send(group, b"qkey")
    assert len(good.poll(1)) == 1
    assert other.poll(1, timeout=0.3) == []
    assert b.counters.drops.get("qkey_violation", 0) == before + 1


def test_attach_errors_as_the_verbs_core_and_rxe(devices):
    """ib_attach_mcast: EINVAL for a QP that is not UD and for a GID that is not multicast
    (IPv4-mapped 10.0.0.1, a unicast IPv6 address); attaching twice is one attach
    (rxe_attach_mcg: nothing to do); detaching a group not attached is EINVAL."""
    a, b, side = devices
    ud, rc = side("mc3x"), side("mc3x", qpt=IBV_QPT_RC)
    group = GID("::ffff:239.3.0.4")
    with pytest.raises(PyverbsRDMAError) as e:
        rc.qp.attach_mcast(group)
    assert e.value.error_code == errno.EINVAL
    for bad in ("::ffff:10.0.0.1", "fe80::1", "2001:db8::1"):
        with pytest.raises(PyverbsRDMAError) as e:
            ud.qp.attach_mcast(GID(bad))
        assert e.value.error_code == errno.EINVAL
    with pytest.raises(PyverbsRDMAError) as e:
        ud.qp.detach_mcast(group)
    assert e.value.error_code == errno.EINVAL
    ud.qp.attach_mcast(group)
    ud.qp.attach_mcast(group)
    assert a.mcast.attached == 1
    ud.qp.detach_mcast(group)
    with pytest.raises(PyverbsRDMAError) as e:
        ud.qp.detach_mcast(group)
    assert e.value.error_code == errno.EINVAL


def test_limits_are_rxes_and_the_57th_qp_of_a_group_is_einval(devices):
    """The device reports rxe's limits (RXE_MAX_MCAST_GRP 8192, RXE_MAX_MCAST_QP_ATTACH 56,
    RXE_MAX_TOT_MCAST_QP_ATTACH 0x70000); a group's 57th QP is refused with EINVAL."""
    a, b, side = devices
    first = side("mc3x")
    attr = first.ctx.query_device()
    assert (attr.max_mcast_grp, attr.max_mcast_qp_attach, attr.max_total_mcast_qp_attach) == \
        (8192, 56, 0x70000)
    group = GID("::ffff:239.3.0.5")
    qps = [first.qp]
    for _ in range(55):
        qps.append(QP(first.pd, QPInitAttr(qp_type=IBV_QPT_UD, scq=first.cq, rcq=first.cq)))
    for q in qps:
        q.attach_mcast(group)
    extra = QP(first.pd, QPInitAttr(qp_type=IBV_QPT_UD, scq=first.cq, rcq=first.cq))
    with pytest.raises(PyverbsRDMAError) as e:
        extra.attach_mcast(group)
    assert e.value.error_code == errno.EINVAL


def test_destroying_a_qp_detaches_it(devices):
    """uverbs detaches a QP's groups before destroying it: the group goes with it."""
    a, b, side = devices
    r = side("mc3y")
    group = GID("::ffff:239.3.0.6")
    r.qp.attach_mcast(group)
    assert bytes([239, 3, 0, 6]) in b.udp.groups
    r.qp.close()
    assert b.mcast.group(bytes([239, 3, 0, 6])) is None
    assert bytes([239, 3, 0, 6]) not in b.udp.groups


# ---- IPv6: a group ff15::3:1 across a veth pair, in a namespace of this test's own ----------

V6_PROGRAM = r"""
import sys, time
from softrdma.verbs_api import *
add_device(sys.argv[1], name="v6a")
b = add_device(sys.argv[2], name="v6b")
def side(name):
    ctx = Context(name=name); pd = PD(ctx); cq = CQ(ctx, 16, None, None, 0)
    qp = QP(pd, QPInitAttr(qp_type=IBV_QPT_UD, scq=cq, rcq=cq,
                           cap=QPCap(max_send_wr=4, max_recv_wr=4)))
    qp.to_rts(QPAttr(qkey=0x42, port_num=1))
    return ctx, pd, cq, qp, MR(pd, 4096, IBV_ACCESS_LOCAL_WRITE)
s, r = side("v6a"), side("v6b")
g = GID(sys.argv[3])
r[3].attach_mcast(g)
r[3].post_recv(RecvWR(wr_id=1, num_sge=1, sg=[SGE(r[4].buf, 200, r[4].lkey)]))
ah = AH(s[1], attr=AHAttr(is_global=1, port_num=1,
                          gr=GlobalRoute(dgid=g, sgid_index=1, hop_limit=64)))
s[4].write(b"six", 3)
wr = SendWR(wr_id=2, opcode=IBV_WR_SEND, num_sge=1, sg=[SGE(s[4].buf, 3, s[4].lkey)])
wr.set_wr_ud(ah, 0xFFFFFF, 0x42)
s[3].post_send(wr)
for _ in range(5000):
    n, wcs = r[2].poll(1)
    if n:
        break
    time.sleep(0.001)
grh = bytes(r[4].read(40, 0))
print(n, n and wcs[0].byte_len, bytes(r[4].read(3, 40)), grh[24:40].hex(), b.counters.icrc_err)
"""


@pytest.fixture
def v6_namespace():
    """A namespace ``mcast3-<pid>`` with a veth pair, fd03::1 and fd03::2 (no DAD)."""
    import os
    import subprocess
    ns = f"mcast3-{os.getpid()}"
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    for cmd in (f"ip netns add {ns}",
                f"ip -n {ns} link add v3a type veth peer name v3b",
                f"ip -n {ns} link set lo up",
                f"ip -n {ns} addr add fd03::1/64 dev v3a nodad",
                f"ip -n {ns} addr add fd03::2/64 dev v3b nodad",
                f"ip -n {ns} link set v3a up", f"ip -n {ns} link set v3b up"):
        r = subprocess.run(cmd.split(), capture_output=True, text=True)
        if r.returncode:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            pytest.fail(f"{cmd}: {r.stderr}")  # root and iproute2: what CI has
    yield ns
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_ipv6_group_across_a_veth(v6_namespace):
    """An IPv6 multicast GID is the group's address itself: the receiving device's socket
    joins ff15::3:1 on its interface (IPV6_JOIN_GROUP), the sender's packet crosses the veth
    with the group as IPv6 destination, its ICRC verified (over IPv6 every field is
    known), and the receive buffer's 40-byte GRH is the IPv6 header naming the group."""
    import os
    import subprocess
    import sys
    from .conftest import ROOT
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(["ip", "netns", "exec", v6_namespace, sys.executable, "-c", V6_PROGRAM,
                        "fd03::1", "fd03::2", "ff15::3:1"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "43", "b'six'", "ff150000000000000000000000030001", "0"]
