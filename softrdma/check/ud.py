"""Rules about UD: the Q_Key a receiver expects, and rxe's PSN numbering per sender.

UD has no connection and no acknowledgements; the DETH carries the Q_Key the receiving QP
checks (9.6) and the sender's QPN. QP1 (the GSI, where the CM talks) always uses the
well-known Q_Key 0x80010000 (C9-49).

UD never resends, so a PSN that jumps ahead is datagrams lost before the capture point, and
one that comes back to fill such a hole was reordered: observations for the recovery report,
not faults. A PSN that goes back to a datagram already captured is a fault, unless it is
that datagram again (the network duplicated it).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..qp.psn import psn_add, psn_diff
from ..wire.headers import GSI_QKEY
from .conversation import Conversations, addr
from .decode import Packet
from .recovery import FlowRecovery
from .rules import Sink

__all__ = ["UdChecker"]

_HOLES = 256  # missing PSNs remembered per sender (a reordered datagram comes back soon)


@dataclass
class _Sender:
    label: str
    rec: FlowRecovery
    expected: int | None = None
    missing: set[int] = field(default_factory=set)
    last: tuple[int, int, int] | None = None  # (PSN, IP ID, CRC) of the previous datagram


class UdChecker:
    """UD rules, one packet at a time; ``mtu`` (the path MTU, which UD packets do not
    reveal) also checks that each datagram fits in one packet."""

    def __init__(self, conv: Conversations, mtu: int | None) -> None:
        self.mtu = mtu
        self.qkey = {k: (GSI_QKEY if k[1] == 1 else Counter(g.qkeys).most_common(1)[0][0])
                     for k, g in conv.ud_receivers.items()}
        self.senders: dict[tuple[bytes, int], _Sender] = {}
        for (src, sqp) in conv.ud_senders:
            self.senders[(src, sqp)] = _Sender(f"{addr(src)} UD QP 0x{sqp:06x}",
                                               FlowRecovery(f"{addr(src)} QP 0x{sqp:06x}", "UD"))

    def on_packet(self, p: Packet, sink: Sink) -> None:
        dk = (p.dst, p.bth.dest_qp)
        want = self.qkey.get(dk)
        if want is not None and p.bth.qkey != want:
            sink.add("UD-QKEY", p.frame, f"Q_Key 0x{p.bth.qkey:08x}, this QP's datagrams "
                                         f"carry 0x{want:08x}",
                     f"{addr(dk[0])} UD QP 0x{dk[1]:06x}")
        s = self.senders.get((p.src, p.bth.src_qp or 0))
        if s is None:
            return
        s.rec.span(p.ts)
        psn, exp = p.psn, s.expected
        ident = (psn, p.ip.ip_id, hash(bytes(p.bth.payload)))
        if exp is not None and psn != exp:
            d = psn_diff(psn, exp)
            if d > 0:
                s.rec.add("lost-before", p.frame, p.ts, exp, d,
                          f"{d} datagram(s) before PSN {psn} never captured (lost before "
                          "the capture point)")
                if len(s.missing) < _HOLES:
                    s.missing.update(psn_add(exp, i) for i in range(min(d, _HOLES)))
            elif psn in s.missing:
                s.missing.discard(psn)
                s.rec.reclassify_reordered(p.frame, p.ts, psn)
                return  # a late datagram does not move the numbering back
            elif s.last is not None and ident == s.last:
                s.rec.add("duplicate", p.frame, p.ts, psn, 1,
                          f"datagram PSN {psn} captured twice (the network duplicated it)")
                return
            else:
                sink.add("UD-PSN", p.frame, f"PSN {psn}, expected {exp} (+1 per datagram "
                                            "from this QP)", s.label)
        s.last = ident
        s.rec.good(p.bth.payload_len)
        s.expected = psn_add(psn, 1)
        if self.mtu is not None and p.bth.payload_len > self.mtu:
            sink.add("MTU-SIZE", p.frame, f"{p.info.name} carries {p.bth.payload_len} "
                                          f"bytes, more than the path MTU {self.mtu}", s.label)

    def recoveries(self) -> list[FlowRecovery]:
        return [s.rec for s in self.senders.values()]
