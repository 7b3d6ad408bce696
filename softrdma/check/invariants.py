"""Rules about what stays the same for a QP: its transport, its P_Key, its UDP source port.

Each value is judged against the commonest value of its group, not the first one, so that
one odd packet is the one reported, wherever it sits in the capture. The survey (the first
pass) counts the values; :func:`on_packet` judges each packet in the second pass and
:func:`check_ports` judges each group's port once.
"""

from __future__ import annotations

from collections import Counter

from ..qp.params import RXE_ROCE_V2_SPORT, udp_sport_for_path, udp_sport_for_qpn
from ..wire.opcodes import Transport
from .conversation import Connection, Conversations, addr
from .decode import Packet
from .rules import Sink

__all__ = ["Invariants"]


def _common(c: Counter):
    return c.most_common(1)[0][0]


class Invariants:
    """The commonest values of every group, from the survey, and the per-packet rules."""

    def __init__(self, conv: Conversations) -> None:
        self.conv = conv
        self.transport = {k: _common(c) for k, c in conv.dest_transports.items()}
        self.conn_pkey = {id(c): _common(c.pkeys) for c in conv.connections}
        self.half_sport = {h.key: h.sport for c in conv.connections for h in (c.a, c.b)
                           if h is not None}
        self.ud_pkey = {k: _common(g.pkeys) for k, g in conv.ud_receivers.items()}
        self.ud_sport = {k: _common(g.sports) for k, g in conv.ud_senders.items()}

    def on_packet(self, p: Packet, sink: Sink) -> None:
        t = self.transport.get((p.dst, p.bth.dest_qp))
        if t is not None and p.info.transport != t and p.info.transport != Transport.CNP:
            sink.add("QP-TRANSPORT", p.frame, f"{p.info.name} to a {Transport(t).name} QP, "
                                              f"expected a {Transport(t).name} opcode",
                     f"{addr(p.dst)} QP 0x{p.bth.dest_qp:06x}")
        it = p.info.transport
        if it == Transport.UD:
            dk = (p.dst, p.bth.dest_qp)
            pkey = self.ud_pkey.get(dk)
            if pkey is not None and p.bth.pkey != pkey:
                sink.add("PKEY", p.frame, f"P_Key 0x{p.bth.pkey:04x}, this QP's packets carry "
                                          f"0x{pkey:04x}", f"{addr(p.dst)} QP 0x{p.bth.dest_qp:06x}")
            sk = (p.src, p.bth.src_qp or 0)
            sport = self.ud_sport.get(sk)
            if sport is not None and p.ip.sport != sport:
                sink.add("SPORT", p.frame, f"UDP source port {p.ip.sport}, this QP sends from "
                                           f"{sport}", f"{addr(p.src)} UD QP 0x{sk[1]:06x}")
            return
        found = self.conv.connection(p)
        if found is None:
            return
        c, h = found
        pkey = self.conn_pkey[id(c)]
        if p.bth.pkey != pkey:
            sink.add("PKEY", p.frame, f"P_Key 0x{p.bth.pkey:04x}, this connection's packets "
                                      f"carry 0x{pkey:04x}", c.label(c.a))
        sport = self.half_sport[h.key]
        if p.ip.sport != sport:
            sink.add("SPORT", p.frame, f"UDP source port {p.ip.sport}, this QP sends from "
                                       f"{sport}", c.label(h))

    def check_ports(self, sink: Sink) -> None:
        """SPORT-HASH, once per group, at the first packet sent from its port."""
        for (src, sqp), g in self.conv.ud_senders.items():
            sport = self.ud_sport[(src, sqp)]
            want = udp_sport_for_qpn(sqp)
            if sport != want:
                sink.add("SPORT-HASH", g.sport_first[sport],
                         f"UDP source port {sport}, rxe sends from {want} for source QP "
                         f"0x{sqp:06x}", f"{addr(src)} UD QP 0x{sqp:06x}")
        for c in self.conv.connections:
            _connection_ports(c, sink)


def _connection_ports(c: Connection, sink: Sink) -> None:
    chosen = []
    for h in (c.a, c.b):
        if h is None:
            continue
        sport = h.sport
        frame, version, label = h.sport_first[sport]
        chosen.append((h, sport, frame, version, label))
        if sport < RXE_ROCE_V2_SPORT:
            sink.add("SPORT-HASH", frame, f"UDP source port {sport}, rxe's ports are "
                                          f"{RXE_ROCE_V2_SPORT}-65535", c.label(h))
    if c.b is None:
        return  # one QPN unknown: nothing to compare
    # rxe hashes the path's flow label, or both QPNs when it is 0 (rdma_get_udp_sport). Both
    # ends share the flow label (rdma_cm derives it from the connection's ports), so both
    # directions send from the same port. IPv4 does not show the flow label: a shared port
    # other than the QPN hash is a flow label we cannot see, not a fault.
    (ha, sa, fa, va, la), (hb, sb, fb, vb, lb) = chosen
    qa, qb = c.a.dest_qp, c.b.dest_qp
    want_a = udp_sport_for_path(la, qa, qb)
    want_b = udp_sport_for_path(lb, qa, qb)
    if sa == sb:
        if va == 6 and sa != want_a:
            sink.add("SPORT-HASH", fa, f"UDP source port {sa}, rxe sends from {want_a} "
                                       f"for flow label 0x{la:05x}", c.label(ha))
        return
    h, s, f, want = (hb, sb, fb, want_b) if sa == want_a or sb != want_b else (ha, sa, fa,
                                                                              want_a)
    sink.add("SPORT-HASH", f, f"UDP source port {s}, but the other direction of the "
                              f"connection sends from {sb if h is ha else sa}; rxe "
                              f"uses one port for both ({want} when the flow label is 0)",
             c.label(h))
