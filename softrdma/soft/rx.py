"""The receive path's header checks (rxe_recv.c): every packet is counted and either
handed to its QP's engine or dropped with a reason; nothing malformed goes further.
Packets for QP 1 (the GSI) go, after the device-wide checks, to ``device.gsi``
(softrdma.soft.gsi), which checks them as rxe and the MAD layer do.

Beyond rxe, a device in strict mode (``SoftDevice(strict=True)`` or SOFTRDMA_STRICT=1) also
drops packets for a connected (RC/UC) QP that do not come from the UDP source port the
connection's path determines (drop reason ``strict_sport``); see docs/security.md."""

from __future__ import annotations

import struct
from typing import Any

from ..completion import AsyncEvent
from ..enums import ibv_event_type, ibv_qp_state as S, ibv_qp_type as T
from ..wire.frames import ip_checksum
from ..wire.headers import ROCE_V2_UDP_DPORT
from ..wire.icrc import icrc_ok_ipv4, icrc_ok_ipv6
from ..wire.opcodes import Transport
from ..wire.packet import DecodeError, parse
from ..counters import Drop

__all__ = ["receive_packet", "synth_ip_header", "trace_packet"]

_MALFORMED = {"truncated": Drop.MALFORMED_TRUNCATED, "unknown_opcode": Drop.MALFORMED_UNKNOWN_OPCODE,
              "bad_pad": Drop.MALFORMED_BAD_PAD}  # DecodeError.reason -> drop reason

_TRANSPORT_OF_QPT = {T.IBV_QPT_RC: Transport.RC, T.IBV_QPT_UC: Transport.UC,
                     T.IBV_QPT_UD: Transport.UD}
_RESP_READY = (S.IBV_QPS_RTR, S.IBV_QPS_RTS, S.IBV_QPS_SQD, S.IBV_QPS_SQE)
_REQ_READY = (S.IBV_QPS_RTS, S.IBV_QPS_SQD)


def synth_ip_header(src: bytes, dst: bytes, payload_len: int, ip_id: int = 0) -> bytes:
    """The IP header a UD receive reports in its 40-byte GRH area when the transport did not
    give us the real one (a UDP socket does not): IPv4 with DF, TTL 64, UDP; or IPv6."""
    if len(src) == 4:
        h = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 28 + payload_len, ip_id, 0x4000, 64,
                                  17, 0, src, dst))
        h[10:12] = ip_checksum(h).to_bytes(2, "big")
        return bytes(h)
    return struct.pack("!IHBB16s16s", 6 << 28, 8 + payload_len, 17, 64, src, dst)


def trace_packet(dev: Any, direction: str, data: Any, pkt: Any = None,
                 qpn: int | None = None, peer: bytes | None = None) -> None:
    """The trace's line for a packet sent (``tx``, by local QP ``qpn``) or received
    (``rx``, for the QP its BTH names): the dissector's line."""
    tr = dev.trace
    if pkt is None:
        try:
            pkt = parse(data)
        except DecodeError:
            return
    if qpn is None:
        qpn = pkt.dest_qp
    if not tr.wants("packet", qpn):
        return
    from ..wire.dissect import packet_line
    import ipaddress
    tr.emit(dev, "packet", qpn, f"{direction} {packet_line(pkt)}", dir=direction,
            opcode=pkt.info.name, psn=pkt.psn, ackreq=pkt.ackreq,
            syndrome=pkt.syndrome, msn=pkt.msn, len=pkt.payload_len, dest_qp=pkt.dest_qp,
            peer=str(ipaddress.ip_address(peer)) if peer else None)


def receive_packet(dev: Any, data: Any, src_ip: bytes, dst_ip: bytes, ip_id: int,
                   ip_header: bytes | None, sport: int, verify: bool) -> None:
    c = dev.counters
    c.rcvd_pkts += 1
    try:
        pkt = parse(data)
    except DecodeError as e:
        c.malformed_pkts += 1
        c.drop(_MALFORMED[e.reason])
        return
    if dev.trace is not None:
        trace_packet(dev, "rx", data, pkt, peer=src_ip)
    if verify:  # one crc32 over the packet from a cached pseudo-header state (wire/icrc.py)
        if len(src_ip) == 4:
            good = icrc_ok_ipv4(pkt.buf, src_ip, dst_ip, sport, ROCE_V2_UDP_DPORT, ip_id)
        else:
            good = icrc_ok_ipv6(pkt.buf, src_ip, dst_ip, sport)
        if not good:
            c.icrc_err += 1
            c.drop(Drop.BAD_ICRC)
            return
    if dev.capture is not None:
        dev.capture.record(bytes(data), src_ip, dst_ip, sport, ip_id=ip_id)
    if dst_ip != dev.ip_packed:
        c.drop(Drop.NOT_OUR_ADDRESS)
        return
    if pkt.tver != 0:
        c.drop(Drop.BAD_TVER)
        return
    info = pkt.info
    if info.transport == Transport.CNP:
        c.drop(Drop.CNP_IGNORED)
        return
    if (pkt.pkey & 0x7FFF) != 0x7FFF:
        c.drop(Drop.BAD_PKEY)
        return
    qpn = pkt.dest_qp
    if qpn <= 1:  # the one comparison QPNs >= 16 pay for the special QPs
        if qpn == 0:
            c.drop(Drop.QP0)
        else:  # QP1, the GSI: its own checks, then the MAD handler (soft/gsi.py)
            dev.gsi.on_packet(pkt, src_ip, dst_ip, sport)
        return
    qp = dev.qps.get(qpn)
    if qp is None or qp.closed:
        c.drop(Drop.NO_QP)
        return
    if _TRANSPORT_OF_QPT.get(qp.qp_type) != info.transport:
        c.drop(Drop.WRONG_TRANSPORT)
        return
    st = qp.state
    if info.is_request:
        if st not in _RESP_READY:
            c.drop(Drop.QP_NOT_READY)
            return
    elif st not in _REQ_READY:
        c.drop(Drop.QP_NOT_READY)
        return
    if qp.qp_type != T.IBV_QPT_UD:
        av = qp.av
        if av is None or av.dst_ip != src_ip:
            c.drop(Drop.WRONG_SOURCE)
            return
        if dev.strict and sport != qp.src_port:
            # strict mode: a connected rxe (or softrdma) peer sends every packet of this
            # connection from the port both ends derive from the path (the flow label, or
            # both QPNs when it is 0), the port we send from (docs/security.md)
            c.drop(Drop.STRICT_SPORT)
            return
    elif pkt.qkey != qp.attr.qkey:
        c.drop(Drop.QKEY_VIOLATION)
        return
    if info.is_request and st == S.IBV_QPS_RTR and not qp.comm_est_sent:
        qp.comm_est_sent = True
        dev.emit_async(AsyncEvent(ibv_event_type.IBV_EVENT_COMM_EST, qp.owner))
    if ip_header is None and qp.qp_type == T.IBV_QPT_UD:
        ip_header = synth_ip_header(src_ip, dst_ip, len(data), ip_id)  # UDP payload length
    qp.on_packet(pkt, ip_header or b"")
