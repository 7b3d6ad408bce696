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
from ..enums import (ibv_access_flags as A, ibv_event_type, ibv_qp_state as S,
                     ibv_qp_type as T)
from ..wire.frames import ip_checksum
from ..wire.headers import ROCE_V2_UDP_DPORT
from ..wire.icrc import icrc_ok_ipv4, icrc_ok_ipv6
from ..wire.opcodes import BTH_SIZE, Opcode as O, Transport
from ..wire.packet import DecodeError, parse
from ..counters import Drop

__all__ = ["receive_packet", "receive_train", "synth_ip_header", "trace_packet"]

_MALFORMED = {"truncated": Drop.MALFORMED_TRUNCATED, "unknown_opcode": Drop.MALFORMED_UNKNOWN_OPCODE,
              "bad_pad": Drop.MALFORMED_BAD_PAD}  # DecodeError.reason -> drop reason

_REMOTE_WRITE = int(A.IBV_ACCESS_REMOTE_WRITE)
_TRANSPORT_OF_QPT = {T.IBV_QPT_RC: Transport.RC, T.IBV_QPT_UC: Transport.UC,
                     T.IBV_QPT_UD: Transport.UD}
_RESP_READY = (S.IBV_QPS_RTR, S.IBV_QPS_RTS, S.IBV_QPS_SQD, S.IBV_QPS_SQE)
# the MIDDLE opcodes a train of one message's body is made of, with the opcodes the
# responder may have seen last for a MIDDLE to be in sequence (its FIRST or a MIDDLE)
_MIDDLE_AFTER = {
    O.RC_SEND_MIDDLE: (O.RC_SEND_FIRST, O.RC_SEND_MIDDLE),
    O.RC_RDMA_WRITE_MIDDLE: (O.RC_RDMA_WRITE_FIRST, O.RC_RDMA_WRITE_MIDDLE),
    O.UC_SEND_MIDDLE: (O.UC_SEND_FIRST, O.UC_SEND_MIDDLE),
    O.UC_RDMA_WRITE_MIDDLE: (O.UC_RDMA_WRITE_FIRST, O.UC_RDMA_WRITE_MIDDLE)}
_WRITE_MIDDLES = (O.RC_RDMA_WRITE_MIDDLE, O.UC_RDMA_WRITE_MIDDLE)
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


def receive_train(dev: Any, parts: list, src_ip: bytes, dst_ip: bytes, sport: int,
                  verify: bool, ip_ids: list[int] | None = None) -> None:
    """The packets of a train received whole (UDP GRO), in order, device lock held.

    Each packet gets exactly what :func:`receive_packet` would give it, but a run of
    MIDDLE packets of the message a QP is receiving is checked as a run: the QP, its
    state, the path and the opcode sequence once; per packet only what can differ (its
    opcode, QPN, length, flags, P_Key, PSN, AckReq); then the responder executes the run
    in one call (:meth:`Responder.take_middles`). Anything else, and any packet the
    shortcut stops at, goes through :func:`receive_packet`. ``ip_ids`` are the packets'
    IPv4 IDs when known (the ICRC covers them; default 0). Callers use this only when no
    capture, trace or receive fault wants each packet on its own."""
    c = dev.counters
    n = len(parts)
    i = 0
    while i < n:
        j, qp = _middle_run(dev, parts, i, src_ip, sport, verify, ip_ids) \
            if dst_ip == dev.ip_packed else (i, None)
        if j > i:
            try:
                done = qp.resp.take_middles(parts[i:j], qp.mtu())
            except Exception as e:  # contained to the QP, as QpEngine.on_packet does
                qp.fault(e, "receive")
                done = j - i
            c.rcvd_pkts += done
            i += done
            if done:
                continue
        # a copy: the parsed packet must not see the receive buffer's next datagram
        receive_packet(dev, bytes(parts[i]), src_ip, dst_ip, ip_ids[i] if ip_ids else 0, None,
                       sport, verify)
        i += 1


def _icrc_good(p: Any, src: bytes, dst: bytes, sport: int, ip_id: int) -> bool:
    if len(src) == 4:
        return icrc_ok_ipv4(p, src, dst, sport, ROCE_V2_UDP_DPORT, ip_id)
    return icrc_ok_ipv6(p, src, dst, sport)


def _middle_run(dev: Any, parts: list, i: int, src_ip: bytes, sport: int, verify: bool,
                ip_ids: list[int] | None) -> tuple[int, Any]:
    """The end of the run of MIDDLE packets from ``parts[i]`` that the QP they are for
    expects next and would take without a question, and that QP; ``(i, None)`` if there
    is none."""
    p = parts[i]
    if len(p) < 16:
        return i, None
    op = p[0]
    after = _MIDDLE_AFTER.get(op)
    if after is None:
        return i, None
    qpn = p[5:8]
    qp = dev.qps.get(int.from_bytes(qpn, "big"))
    if qp is None or qp.closed:
        return i, None
    st = qp.state
    if st not in _RESP_READY or (st == S.IBV_QPS_RTR and not qp.comm_est_sent):
        return i, None
    qpt = qp.qp_type
    if qpt != (T.IBV_QPT_RC if op < 0x20 else T.IBV_QPT_UC):
        return i, None
    av = qp.av
    if av is None or av.dst_ip != src_ip or (dev.strict and sport != qp.src_port):
        return i, None
    resp = qp.resp
    if resp.opcode not in after or (qpt == T.IBV_QPT_UC and resp.drop_msg):
        return i, None
    if op in _WRITE_MIDDLES and not int(qp.attr.qp_access_flags) & _REMOTE_WRITE:
        return i, None
    size = BTH_SIZE + qp.mtu() + 4
    psn = resp.psn
    j = i
    n = len(parts)
    while j < n:
        p = parts[j]
        # opcode, flags 0 (no SE, MigReq, pad or TVer), a full P_Key, the QP, AckReq clear
        # and the next PSN: anything else is for receive_packet to judge
        if len(p) != size or p[0] != op or p[1] != 0 or p[5:8] != qpn or p[8] & 0x80 or \
                (p[3] != 0xFF or p[2] & 0x7F != 0x7F) or \
                int.from_bytes(p[9:12], "big") != psn:
            break
        if verify and not _icrc_good(p, src_ip, dev.ip_packed, sport,
                                     ip_ids[j] if ip_ids else 0):
            break  # receive_packet counts and drops it
        psn = (psn + 1) & 0xFFFFFF
        j += 1
    return j, qp
