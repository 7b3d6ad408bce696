"""Rules about what stays the same for a QP: its transport, its P_Key, its UDP source port.

Each value is judged against the commonest value of its group, not the first one, so that
one odd packet is the one reported, wherever it sits in the capture.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Hashable, Iterable

from ..qp.params import RXE_ROCE_V2_SPORT, udp_sport_for_path, udp_sport_for_qpn
from ..wire.opcodes import Transport
from .conversation import Connection, Conversations, addr
from .decode import Packet
from .rules import Sink

__all__ = ["check_invariants"]


def _odd_ones(packets: Iterable[Packet], key: Callable[[Packet], Hashable],
              ) -> tuple[Hashable, list[Packet]]:
    packets = list(packets)
    common = Counter(key(p) for p in packets).most_common(1)[0][0]
    return common, [p for p in packets if key(p) != common]


def check_invariants(conv: Conversations, sink: Sink) -> None:
    for (dst, qpn), packets in conv.by_dest.items():
        label = f"{addr(dst)} QP 0x{qpn:06x}"
        t, odd = _odd_ones(packets, lambda p: p.info.transport)
        for p in odd:
            sink.add("QP-TRANSPORT", p.frame, f"{p.info.name} to a {Transport(t).name} QP, "
                                              f"expected a {Transport(t).name} opcode", label)
    for c in conv.connections:
        _connection(c, sink)
    for (dst, qpn), packets in conv.ud_receivers.items():
        pkey, odd = _odd_ones(packets, lambda p: p.bth.pkey)
        for p in odd:
            sink.add("PKEY", p.frame, f"P_Key 0x{p.bth.pkey:04x}, this QP's packets carry "
                                      f"0x{pkey:04x}", f"{addr(dst)} QP 0x{qpn:06x}")
    for (src, sqp), packets in conv.ud_senders.items():
        label = f"{addr(src)} UD QP 0x{sqp:06x}"
        sport, odd = _odd_ones(packets, lambda p: p.ip.sport)
        for p in odd:
            sink.add("SPORT", p.frame, f"UDP source port {p.ip.sport}, this QP sends from "
                                       f"{sport}", label)
        want = udp_sport_for_qpn(sqp)
        if sport != want:
            first = next(p for p in packets if p.ip.sport == sport)
            sink.add("SPORT-HASH", first.frame, f"UDP source port {sport}, rxe sends from "
                                                f"{want} for source QP 0x{sqp:06x}", label)


def _connection(c: Connection, sink: Sink) -> None:
    halves = [h for h in (c.a, c.b) if h is not None]
    both = [p for h in halves for p in h.packets]
    pkey, odd = _odd_ones(both, lambda p: p.bth.pkey)
    for p in odd:
        sink.add("PKEY", p.frame, f"P_Key 0x{p.bth.pkey:04x}, this connection's packets "
                                  f"carry 0x{pkey:04x}", c.label(c.a))
    chosen = []
    for h in halves:
        sport, odd = _odd_ones(h.packets, lambda p: p.ip.sport)
        for p in odd:
            sink.add("SPORT", p.frame, f"UDP source port {p.ip.sport}, this QP sends from "
                                       f"{sport}", c.label(h))
        first = next(p for p in h.packets if p.ip.sport == sport)
        chosen.append((h, sport, first))
        if sport < RXE_ROCE_V2_SPORT:
            sink.add("SPORT-HASH", first.frame, f"UDP source port {sport}, rxe's ports are "
                                                f"{RXE_ROCE_V2_SPORT}-65535", c.label(h))
    if c.b is None:
        return  # one QPN unknown: nothing to compare
    # rxe hashes the path's flow label, or both QPNs when it is 0 (rdma_get_udp_sport). Both
    # ends share the flow label (rdma_cm derives it from the connection's ports), so both
    # directions send from the same port. IPv4 does not show the flow label: a shared port
    # other than the QPN hash is a flow label we cannot see, not a fault.
    (ha, sa, fa), (hb, sb, fb) = chosen
    qa, qb = c.a.dest_qp, c.b.dest_qp
    want_a = udp_sport_for_path(fa.ip.flow_label, qa, qb)
    want_b = udp_sport_for_path(fb.ip.flow_label, qa, qb)
    if sa == sb:
        if fa.ip.ip_version == 6 and sa != want_a:
            sink.add("SPORT-HASH", fa.frame, f"UDP source port {sa}, rxe sends from {want_a} "
                                             f"for flow label 0x{fa.ip.flow_label:05x}",
                     c.label(ha))
        return
    h, s, f, want = (hb, sb, fb, want_b) if sa == want_a or sb != want_b else (ha, sa, fa,
                                                                              want_a)
    sink.add("SPORT-HASH", f.frame, f"UDP source port {s}, but the other direction of the "
                                    f"connection sends from {sb if h is ha else sa}; rxe "
                                    f"uses one port for both ({want} when the flow label is 0)",
             c.label(h))
