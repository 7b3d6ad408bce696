"""Rules about UD: the Q_Key a receiver expects, and rxe's PSN numbering per sender.

UD has no connection and no acknowledgements; the DETH carries the Q_Key the receiving QP
checks (9.6) and the sender's QPN. QP1 (the GSI, where the CM talks) always uses the
well-known Q_Key 0x80010000 (C9-49).
"""

from __future__ import annotations

from collections import Counter

from ..qp.psn import psn_add, psn_diff
from ..wire.headers import GSI_QKEY
from .conversation import Conversations, addr
from .rules import Sink

__all__ = ["check_ud"]


def check_ud(conv: Conversations, sink: Sink, mtu: int | None = None,
             lossy: bool = False) -> None:
    """UD rules; with ``mtu`` (the path MTU, which UD packets do not reveal) also that each
    datagram fits in one packet; with ``lossy``, a PSN that jumps ahead is a lost datagram
    (UD never resends), not a fault."""
    for (dst, qpn), packets in conv.ud_receivers.items():
        label = f"{addr(dst)} UD QP 0x{qpn:06x}"
        if qpn == 1:
            want = GSI_QKEY
        else:
            want = Counter(p.bth.qkey for p in packets).most_common(1)[0][0]
        for p in packets:
            if p.bth.qkey != want:
                sink.add("UD-QKEY", p.frame, f"Q_Key 0x{p.bth.qkey:08x}, this QP's datagrams "
                                             f"carry 0x{want:08x}", label)
    for (src, sqp), packets in conv.ud_senders.items():
        label = f"{addr(src)} UD QP 0x{sqp:06x}"
        expected = None
        for p in packets:
            if expected is not None and p.psn != expected and not (
                    lossy and psn_diff(p.psn, expected) > 0):
                sink.add("UD-PSN", p.frame, f"PSN {p.psn}, expected {expected} (+1 per "
                                            "datagram from this QP)", label)
            expected = psn_add(p.psn, 1)
            if mtu is not None and p.bth.payload_len > mtu:
                sink.add("MTU-SIZE", p.frame, f"{p.info.name} carries {p.bth.payload_len} "
                                              f"bytes, more than the path MTU {mtu}", label)
