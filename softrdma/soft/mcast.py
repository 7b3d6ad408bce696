"""Multicast groups of a soft device (rxe_mcast.c, rxe_recv.c's ``rxe_rcv_mcast_pkt``).

A UD QP attaches to a group by its multicast GID (``ibv_attach_mcast``): an IPv4 group
address mapped into a GID (``::ffff:239.1.2.3``) or an IPv6 multicast address (``ff..``).
The first attach of a GID makes the group and has the device's sockets join the IP group
on the device's interface (rxe joins on its UDP tunnel socket: ``ip_mc_join_group`` /
``ipv6_sock_mc_join``), so packets sent to the group arrive from the network; the last
detach leaves it again.

A packet whose BTH names QP 0xFFFFFF (IB_MULTICAST_QPN) and whose IP destination is a
group's goes to every QP attached to that group, each its own copy, each checked as rxe
checks it (the QP's type and state, its Q_Key); a QP that fails a check is skipped, the
others still get theirs. A packet for a group nobody attached is dropped
(``no_mcast_group``).

The rules of rxe and the verbs core: attaching a QP that is not UD, or a GID that is not
multicast, is EINVAL (``ib_attach_mcast``); attaching twice is one attach (no error);
detaching a group the QP is not in is EINVAL; the limits ``max_mcast_grp`` (groups per
device), ``max_mcast_qp_attach`` (QPs per group) and ``max_total_mcast_qp_attach`` are
EINVAL when passed. Destroying a QP detaches it, as uverbs does before it destroys.
"""

from __future__ import annotations

import errno
from typing import Any

from ..counters import Drop

__all__ = ["MULTICAST_QPN", "McastGroup", "McastTable", "is_multicast_gid", "gid_ip"]

MULTICAST_QPN = 0xFFFFFF  # IB_MULTICAST_QPN: a BTH dest QPN that means "the group"
_V4_MAPPED = bytes(10) + b"\xff\xff"


def is_multicast_gid(gid: bytes) -> bool:
    """``rdma_is_multicast_addr``: an IPv4-mapped GID of a 224/4 address, or ff00::/8."""
    gid = bytes(gid)
    if len(gid) != 16:
        return False
    if gid[:12] == _V4_MAPPED:
        return gid[12] & 0xF0 == 0xE0
    return gid[0] == 0xFF


def gid_ip(gid: bytes) -> bytes:
    """The IP address a multicast GID stands for: 4 bytes if IPv4-mapped, else 16."""
    gid = bytes(gid)
    return gid[12:] if gid[:12] == _V4_MAPPED else gid


class McastGroup:
    """One group (rxe's ``rxe_mcg``): its GID, its IP address and the attached QPs."""

    __slots__ = ("mgid", "ip", "qps")

    def __init__(self, mgid: bytes) -> None:
        self.mgid = mgid
        self.ip = gid_ip(mgid)
        self.qps: list[Any] = []  # QP engines, in the order they attached

    def __repr__(self) -> str:
        return f"<McastGroup {self.mgid.hex()} qps={[q.qp_num for q in self.qps]}>"


class McastTable:
    """A device's multicast groups, by IP address (what a received packet carries)."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.groups: dict[bytes, McastGroup] = {}
        self.attached = 0  # rxe's mcg_attach: attaches over all groups

    def group(self, ip: bytes) -> McastGroup | None:
        return self.groups.get(bytes(ip))

    def groups_of(self, engine: Any) -> list[bytes]:
        """The GIDs of the groups ``engine`` is attached to."""
        return [g.mgid for g in self.groups.values() if engine in g.qps]

    def attach(self, engine: Any, mgid: bytes) -> None:
        """Attach ``engine`` (a UD QP's) to ``mgid`` (device lock held); OSError(EINVAL)
        at a limit, the socket's error if the IP group cannot be joined."""
        mgid = bytes(mgid)
        lim = self.device.limits
        ip = gid_ip(mgid)
        g = self.groups.get(ip)
        if g is not None and engine in g.qps:
            return  # rxe_attach_mcg: already there, nothing to do
        if g is None:
            if len(self.groups) >= lim.max_mcast_grp:
                raise OSError(errno.EINVAL, f"max_mcast_grp ({lim.max_mcast_grp}) groups "
                                            f"already")
        if self.attached >= lim.max_total_mcast_qp_attach:
            raise OSError(errno.EINVAL, "max_total_mcast_qp_attach reached")
        if g is not None and len(g.qps) >= lim.max_mcast_qp_attach:
            raise OSError(errno.EINVAL, f"max_mcast_qp_attach ({lim.max_mcast_qp_attach}) "
                                        f"QPs in this group already")
        if g is None:
            udp = self.device.udp
            if udp is not None:
                udp.join_group(ip)
            g = self.groups[ip] = McastGroup(mgid)
        g.qps.append(engine)
        self.attached += 1

    def detach(self, engine: Any, mgid: bytes) -> None:
        """Detach ``engine`` from ``mgid``; EINVAL if it is not attached (rxe_detach_mcast)."""
        ip = gid_ip(bytes(mgid))
        g = self.groups.get(ip)
        if g is None or engine not in g.qps:
            raise OSError(errno.EINVAL, "the QP is not attached to this group")
        g.qps.remove(engine)
        self.attached -= 1
        if not g.qps:
            del self.groups[ip]
            udp = self.device.udp
            if udp is not None:
                udp.leave_group(ip)

    def detach_all(self, engine: Any) -> None:
        """A QP is destroyed: out of every group (uverbs' ``ib_uverbs_detach_umcast``)."""
        for mgid in self.groups_of(engine):
            self.detach(engine, mgid)

    def rejoin(self) -> None:
        """The device got sockets (attach_udp) after QPs attached: join their groups."""
        udp = self.device.udp
        if udp is not None:
            for ip in self.groups:
                udp.join_group(ip)

    def deliver(self, data: Any, pkt: Any, src_ip: bytes, dst_ip: bytes, ip_header: bytes,
                check: Any) -> None:
        """A packet for QPN 0xFFFFFF: a copy to each attached QP that ``check(qp)`` (the
        receive path's type/state/Q_Key checks, returning a Drop or None) lets through."""
        dev = self.device
        g = self.groups.get(bytes(dst_ip))
        if g is None:
            dev.counters.drop(Drop.NO_MCAST_GROUP)
            return
        from ..wire.packet import parse
        qps = list(g.qps)
        for i, qp in enumerate(qps):
            why = check(qp)
            if why is not None:
                dev.counters.drop(why)
                continue
            # each QP its own copy: a parsed packet is the QP's to keep (the last takes ours)
            qp.on_packet(pkt if i == len(qps) - 1 else parse(bytes(data)), ip_header)
