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
from ..wire.headers import (
    BTH_ACK_OFFSET, BTH_FLAGS_OFFSET, BTH_OPCODE_OFFSET, BTH_PAD_MASK, BTH_PKEY_OFFSET,
    BTH_PSN_MASK, BTH_QPN_OFFSET, BTH_TVER_MASK, ROCE_V2_UDP_DPORT,
)
from ..wire.icrc import (
    RC_FLUSH_OPCODE, icrc_ipv4, icrc_ipv6, icrc_ok_ipv4, icrc_ok_ipv6, rxe_flush_icrc_ok,
)
from ..wire.opcodes import BTH_SIZE, ICRC_SIZE, OPCODE_LIST, Transport
from ..wire.packet import DecodeError, parse
from ..counters import Drop
from .mcast import MULTICAST_QPN

__all__ = ["receive_packet", "receive_train", "drop_reason", "next_middle",
           "synth_ip_header", "trace_packet"]

_MALFORMED = {"truncated": Drop.MALFORMED_TRUNCATED, "unknown_opcode": Drop.MALFORMED_UNKNOWN_OPCODE,
              "bad_pad": Drop.MALFORMED_BAD_PAD}  # DecodeError.reason -> drop reason

_TRANSPORT_OF_QPT = {T.IBV_QPT_RC: Transport.RC, T.IBV_QPT_UC: Transport.UC,
                     T.IBV_QPT_UD: Transport.UD}
_RESP_READY = (S.IBV_QPS_RTR, S.IBV_QPS_RTS, S.IBV_QPS_SQD, S.IBV_QPS_SQE)
_REQ_READY = (S.IBV_QPS_RTS, S.IBV_QPS_SQD)
# plain names for the members tested per packet (an Enum member lookup costs each time)
_CNP, _UD, _RTR = Transport.CNP, T.IBV_QPT_UD, S.IBV_QPS_RTR
# The P_Key's partition, without the membership bit (its top bit): only the default
# partition is accepted, by full and limited members alike (rxe's check_keys, pkey index 0).
_PARTITION = 0x7FFF
_FLAGS, _PKEY, _QPN, _ACK = BTH_FLAGS_OFFSET, BTH_PKEY_OFFSET, BTH_QPN_OFFSET, BTH_ACK_OFFSET
# A run's first packet's bytes up to the AckReq byte, as an int, sit this far up in its BTH
_HEAD_SHIFT = (BTH_SIZE - BTH_ACK_OFFSET) * 8


def synth_ip_header(src: bytes, dst: bytes, payload_len: int, ip_id: int = 0,
                    tos: int = 0) -> bytes:
    """The IP header a UD receive reports in its 40-byte GRH area when the transport did not
    give us the real one (a UDP socket does not): IPv4 with DF, TTL 64, UDP; or IPv6. ``tos``:
    the TOS / traffic class the packet came with (IP_RECVTOS), which rxe's GRH shows."""
    if len(src) == 4:
        h = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, tos, 28 + payload_len, ip_id, 0x4000,
                                  64, 17, 0, src, dst))
        h[10:12] = ip_checksum(h).to_bytes(2, "big")
        return bytes(h)
    return struct.pack("!IHBB16s16s", 6 << 28 | tos << 20, 8 + payload_len, 17, 64, src, dst)


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


def drop_reason(dev: Any, buf: Any, info: Any, qpn: int, qp: Any, src_ip: bytes,
                dst_ip: bytes, sport: int, qkey: int | None) -> Drop | None:
    """Why the device drops a packet that ``parse`` accepted, or None to deliver it: the
    header checks of rxe_recv.c, in its order (the address, TVer, the RoCEv2 CNP, the
    P_Key, QP0) and those of the QP it names (check_type_state, check_addr, check_keys).

    ``buf`` is the packet (its BTH bytes are read at wire.headers' offsets), ``info`` its
    opcode's row, ``qpn`` its destination QP and ``qp`` that QP (None: none), ``qkey`` its
    DETH Q_Key (UD only). QPN 1 passes: the GSI makes its own checks (soft/gsi.py).

    The one decision both receive paths take: :func:`receive_packet` for every packet,
    :func:`receive_train` for the first packet of a run, whose header bytes every later
    packet of the run must repeat (:func:`next_middle`). A check added here holds for both."""
    if dst_ip != dev.ip_packed:
        return Drop.NOT_OUR_ADDRESS
    if buf[_FLAGS] & BTH_TVER_MASK:
        return Drop.BAD_TVER
    if info.transport == _CNP:
        return Drop.CNP_IGNORED
    if (buf[_PKEY] << 8 | buf[_PKEY + 1]) & _PARTITION != _PARTITION:
        return Drop.BAD_PKEY
    if qpn <= 1:  # the one comparison QPNs >= 16 pay for the special QPs
        return Drop.QP0 if qpn == 0 else None
    if qp is None or qp.closed:
        return Drop.NO_QP
    if _TRANSPORT_OF_QPT.get(qp.qp_type) != info.transport:
        return Drop.WRONG_TRANSPORT
    st = qp.state
    if info.is_request:
        if st not in _RESP_READY:
            return Drop.QP_NOT_READY
    elif st not in _REQ_READY:
        return Drop.QP_NOT_READY
    if qp.qp_type != _UD:
        av = qp.av
        if av is None or av.dst_ip != src_ip:
            return Drop.WRONG_SOURCE
        if dev.strict and sport != qp.src_port:
            # strict mode: a connected rxe (or softrdma) peer sends every packet of this
            # connection from the port both ends derive from the path (the flow label, or
            # both QPNs when it is 0), the port we send from (docs/security.md)
            return Drop.STRICT_SPORT
    elif qkey != qp.attr.qkey:
        return Drop.QKEY_VIOLATION
    return None


def _icrc_good(p: Any, src: bytes, dst: bytes, sport: int, ip_id: int) -> bool:
    """The ICRC check, one crc32 over the packet from a cached pseudo-header state
    (wire/icrc.py), over IPv4 or IPv6."""
    if len(src) == 4:
        return icrc_ok_ipv4(p, src, dst, sport, ROCE_V2_UDP_DPORT, ip_id)
    return icrc_ok_ipv6(p, src, dst, sport)


def _rxe_flush_icrc(p: Any, src: bytes, dst: bytes, sport: int, ip_id: int) -> bool:
    """A FLUSH whose ICRC is rxe's (wire/icrc.py rxe_flush_icrc): accepted, as the FLUSH of
    a Linux rxe requester carries it."""
    if len(src) == 4:
        ibta = icrc_ipv4(p, src, dst, sport, ROCE_V2_UDP_DPORT, ip_id)
    else:
        ibta = icrc_ipv6(p, src, dst, sport)
    return rxe_flush_icrc_ok(p, ibta)


def receive_packet(dev: Any, data: Any, src_ip: bytes, dst_ip: bytes, ip_id: int,
                   ip_header: bytes | None, sport: int, verify: bool) -> None:
    """One packet: counted, parsed, its ICRC checked, then judged by :func:`drop_reason`:
    dropped with the reason it gives, else handed to its QP (or the GSI)."""
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
    if verify:  # _icrc_good, inlined: a call per packet costs
        if len(src_ip) == 4:
            good = icrc_ok_ipv4(data, src_ip, dst_ip, sport, ROCE_V2_UDP_DPORT, ip_id)
        else:
            good = icrc_ok_ipv6(data, src_ip, dst_ip, sport)
        if not good and not (data[0] == RC_FLUSH_OPCODE and _rxe_flush_icrc(data, src_ip,
                                                                             dst_ip, sport,
                                                                             ip_id)):
            c.icrc_err += 1
            c.drop(Drop.BAD_ICRC)
            return
    if dev.capture is not None:
        dev.capture.record(bytes(data), src_ip, dst_ip, sport, ip_id=ip_id)
    info = pkt.info
    qpn = pkt.dest_qp
    if qpn == MULTICAST_QPN:
        _receive_mcast(dev, data, pkt, src_ip, dst_ip, ip_id, ip_header)
        return
    qp = dev.qps.get(qpn)
    why = drop_reason(dev, data, info, qpn, qp, src_ip, dst_ip, sport, pkt.qkey)
    if why is not None:
        c.drop(why)
        return
    if qpn == 1:  # the GSI: its own checks, then the MAD handler (soft/gsi.py)
        dev.gsi.on_packet(pkt, src_ip, dst_ip, sport)
        return
    if info.is_request and qp.state == _RTR and not qp.comm_est_sent:
        qp.comm_est_sent = True
        dev.emit_async(AsyncEvent(ibv_event_type.IBV_EVENT_COMM_EST, qp.owner))
    if ip_header is None and qp.qp_type == _UD:
        ip_header = synth_ip_header(src_ip, dst_ip, len(data), ip_id)  # UDP payload length
    qp.on_packet(pkt, ip_header or b"")


def _receive_mcast(dev: Any, data: Any, pkt: Any, src_ip: bytes, dst_ip: bytes, ip_id: int,
                   ip_header: bytes | None) -> None:
    """A packet for QPN 0xFFFFFF (rxe_rcv_mcast_pkt): the device-wide checks of
    :func:`drop_reason` (rxe's hdr_check runs them before it looks at the QPN; the
    destination, a multicast address, passes rxe_chk_dgid), then a copy for each QP
    attached to the group, each checked on its own (check_type_state, check_keys)."""
    buf, info = data, pkt.info
    if buf[_FLAGS] & BTH_TVER_MASK:
        dev.counters.drop(Drop.BAD_TVER)
        return
    if (buf[_PKEY] << 8 | buf[_PKEY + 1]) & _PARTITION != _PARTITION:
        dev.counters.drop(Drop.BAD_PKEY)
        return
    if ip_header is None:
        ip_header = synth_ip_header(src_ip, dst_ip, len(data), ip_id)
    qkey = pkt.qkey

    def check(qp: Any) -> Drop | None:
        if qp.closed:
            return Drop.NO_QP
        if _TRANSPORT_OF_QPT.get(qp.qp_type) != info.transport:
            return Drop.WRONG_TRANSPORT
        if qp.state not in _RESP_READY:
            return Drop.QP_NOT_READY
        if qkey != qp.attr.qkey:
            return Drop.QKEY_VIOLATION
        return None

    dev.mcast.deliver(data, pkt, src_ip, dst_ip, ip_header, check)


def receive_train(dev: Any, parts: list, src_ip: bytes, dst_ip: bytes, sport: int,
                  verify: bool, ip_ids: list[int] | None = None) -> None:
    """The packets of a train received whole (UDP GRO), in order, device lock held.

    Each packet gets exactly what :func:`receive_packet` would give it, but a run of
    MIDDLE packets of the message a QP is receiving is checked as a run: the first packet
    by the :func:`drop_reason` every packet gets on the other path, the rest by
    :func:`next_middle` (the first one's header bytes again, the next PSN, no AckReq, a
    full MTU), the ICRC of each; the responder says whether it expects such a MIDDLE
    (:meth:`Responder.expects_middle`) and executes the run in one call
    (:meth:`Responder.take_middles`). Anything else, and any packet the shortcut stops at,
    goes through :func:`receive_packet`. ``ip_ids`` are the packets' IPv4 IDs when known
    (the ICRC covers them; default 0). Callers use this only when no capture, trace or
    receive fault wants each packet on its own."""
    c = dev.counters
    n = len(parts)
    i = 0
    while i < n:
        j, qp = _middle_run(dev, parts, i, src_ip, dst_ip, sport, verify, ip_ids)
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
        # zero copy: the view itself (whatever keeps a packet past the call copies it:
        # the responder's held requests, the capture); off: a copy, as before
        p = parts[i]
        receive_packet(dev, p if dev.zero_copy else bytes(p), src_ip, dst_ip,
                       ip_ids[i] if ip_ids else 0, None, sport, verify)
        i += 1


def next_middle(p: Any, size: int, head: int, psn: int) -> bool:
    """Whether ``p`` is the next packet of a run of MIDDLEs: ``size`` bytes (a full MTU of
    payload) and a BTH that is ``head`` (the run's first packet's bytes before the AckReq
    byte: opcode, flags, P_Key, FECN/BECN, QPN, shifted into place), then AckReq and resv7
    clear and PSN ``psn``. What :func:`drop_reason` decided for the first packet it decides
    the same for such a packet, so it needs no other check."""
    return len(p) == size and int.from_bytes(p[:BTH_SIZE], "big") == head | psn


def _middle_run(dev: Any, parts: list, i: int, src_ip: bytes, dst_ip: bytes, sport: int,
                verify: bool, ip_ids: list[int] | None) -> tuple[int, Any]:
    """The end of the run of MIDDLE packets from ``parts[i]`` that the QP they are for
    expects next and would take without a question, and that QP; ``(i, None)`` if there
    is none. Anything it does not take, :func:`receive_packet` judges."""
    p = parts[i]
    if len(p) < BTH_SIZE + ICRC_SIZE:
        return i, None
    info = OPCODE_LIST[p[BTH_OPCODE_OFFSET]]
    # a request MIDDLE without pad: parse takes it whole (the length is checked below)
    if info is None or not info.middle or not info.is_request or p[_FLAGS] & BTH_PAD_MASK:
        return i, None
    qpn = int.from_bytes(p[_QPN:_ACK], "big")
    qp = dev.qps.get(qpn)
    if qpn == 1 or drop_reason(dev, p, info, qpn, qp, src_ip, dst_ip, sport, None) is not None:
        return i, None  # the GSI's, or dropped: receive_packet's
    if qp.state == _RTR and not qp.comm_est_sent:
        return i, None  # receive_packet raises IBV_EVENT_COMM_EST first
    resp = qp.resp
    if not resp.expects_middle(info.opcode):
        return i, None
    size = info.length + qp.mtu() + ICRC_SIZE
    head = int.from_bytes(p[:_ACK], "big") << _HEAD_SHIFT
    psn = resp.psn
    own = dev.ip_packed
    j = i
    n = len(parts)
    while j < n:
        p = parts[j]
        if not next_middle(p, size, head, psn):
            break
        if verify and not _icrc_good(p, src_ip, own, sport, ip_ids[j] if ip_ids else 0):
            break  # receive_packet counts and drops it
        psn = (psn + 1) & BTH_PSN_MASK
        j += 1
    return j, qp
