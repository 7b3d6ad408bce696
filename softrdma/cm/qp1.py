"""QP1, the general services interface (GSI) queue pair, as CM MADs travel on RoCEv2.

On RoCE there is no QP0; QP1 carries the MADs, and rxe treats it as a UD QP. Every CM
message is one UD SEND_ONLY packet (from Linux 6.1 rxe, ``pcaps/linux-rxe/ucmatose.pcap``):

* BTH: opcode UD_SEND_ONLY (0x64), P_Key 0xFFFF, destination QP 1, AckReq set (rxe sets
  it on every last/only packet; UD ignores it), PSN from QP1's own counter (nobody
  checks it);
* DETH: Q_Key 0x80010000 (``IB_QP1_QKEY``, the GSI's well-known key) and source QP 1;
* payload: the 256-byte MAD, so no pad;
* UDP source port 55410 from both hosts: rxe picks a QP's source port when it creates the
  QP, ``0xC000 + (hash_32(qpn, 14) & 0x3FFF)``, which is 0xD872 for QPN 1, and QP1 never
  gets a path that would change it. Receivers ignore the source port.

rxe (drivers/infiniband/sw/rxe/rxe_recv.c) drops a packet for QP1 whose P_Key does not
match the default partition or whose Q_Key is not the GSI's, and the MAD layer
(drivers/infiniband/core/mad.c) drops MADs that are not what the CM takes
(:func:`softrdma.cm.mad.cm_mad_drop_reason`). :func:`qp1_drop_reason` states the packet
checks, for a receive path and for the dissector.

    >>> from softrdma.wire.packet import parse
    >>> p = parse(build_qp1(bytes(256), psn=9))
    >>> p.name, p.dest_qp, p.qkey == GSI_QKEY, p.src_qp, p.payload_len, qp1_drop_reason(p)
    ('UD_SEND_ONLY', 1, True, 1, 256, None)
"""

from __future__ import annotations

from ..wire.headers import DEFAULT_PKEY, GSI_QKEY, PSN_MASK
from ..wire.opcodes import Opcode
from ..wire.packet import RocePacket, build
from .mad import MAD_SIZE

__all__ = ["QP1_QPN", "GSI_QKEY", "QP1_PKEY", "QP1_UDP_SPORT", "build_qp1",
           "qp1_drop_reason", "pkey_match"]

QP1_QPN = 1
QP1_PKEY = DEFAULT_PKEY
#: rxe's UDP source port for QP1: ``udp_sport_for_qpn(1)`` of softrdma.qp.params (a test
#: holds the two together, and to the capture), named here so cm needs nothing above wire.
QP1_UDP_SPORT = 55410


def build_qp1(mad: bytes | bytearray, *, psn: int = 0, pkey: int = QP1_PKEY,
              qkey: int = GSI_QKEY, src_qp: int = QP1_QPN, ackreq: bool = True) -> bytearray:
    """The RoCE packet (BTH .. ICRC) carrying one MAD to QP1, as rxe sends it. The ICRC
    is left zero: the framing fills it (``encode_frame``, or the device's send path),
    since it covers the IP and UDP headers. The keyword arguments exist for crafting."""
    if len(mad) != MAD_SIZE:
        raise ValueError(f"QP1 carries {MAD_SIZE}-byte MADs, got {len(mad)} bytes")
    return build(Opcode.UD_SEND_ONLY, psn=psn & PSN_MASK, dest_qp=QP1_QPN, ackreq=ackreq,
                 pkey=pkey, qkey=qkey, src_qp=src_qp, payload=mad)


def pkey_match(a: int, b: int) -> bool:
    """IBTA P_Key matching (rxe's ``pkey_match``): the same 15-bit key, not 0, and at
    least one side a full member (bit 15)."""
    return (a & 0x7FFF) != 0 and (a & 0x7FFF) == (b & 0x7FFF) and bool((a | b) & 0x8000)


def qp1_drop_reason(pkt: RocePacket) -> str | None:
    """Why a packet to QP1 would not reach the CM as a MAD (``None``: it would).

    Stable tokens, for counters: ``not_qp1`` (another destination QP), ``opcode`` (not
    UD_SEND_ONLY: the GSI takes SENDs of one packet), ``pkey`` (not the default
    partition), ``qkey`` (not 0x80010000), ``mad_size`` (not a 256-byte payload). The
    MAD's own header is judged by :func:`softrdma.cm.mad.cm_mad_drop_reason`."""
    if pkt.dest_qp != QP1_QPN:
        return "not_qp1"
    if pkt.opcode != Opcode.UD_SEND_ONLY:
        return "opcode"
    if not pkey_match(pkt.pkey, QP1_PKEY):
        return "pkey"
    if pkt.qkey != GSI_QKEY:
        return "qkey"
    if pkt.payload_len != MAD_SIZE:
        return "mad_size"
    return None
