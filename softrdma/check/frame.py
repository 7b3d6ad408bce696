"""Rules about one packet on its own: ICRC, TVer, reserved bits, pad count, payload presence.

These need no conversation: a receiver (rxe_recv.c) drops such a packet before it looks
at any QP state.
"""

from __future__ import annotations

from ..wire.icrc import RC_FLUSH_OPCODE, rxe_flush_icrc
from ..wire.opcodes import Hdr
from .decode import Packet
from .rules import Sink

__all__ = ["check_frame"]


def check_frame(p: Packet, sink: Sink) -> None:
    b = p.bth
    info = b.info
    expected = p.ip.icrc()
    if b.icrc != expected:
        if b.opcode == RC_FLUSH_OPCODE and b.icrc == rxe_flush_icrc(expected, b.buf):
            sink.add("FLUSH-ICRC", p.frame, f"ICRC 0x{b.icrc:08x} is Linux rxe's for a FLUSH "
                                            f"(its headers hashed twice), IBTA's is "
                                            f"0x{expected:08x}")
        else:
            sink.add("ICRC", p.frame, f"ICRC 0x{b.icrc:08x}, expected 0x{expected:08x}")
    if b.tver != 0:
        sink.add("TVER", p.frame, f"TVer {b.tver}, expected 0")
    if b.resv6 or b.resv7:
        sink.add("RESERVED", p.frame, f"BTH resv6a=0x{b.resv6:02x} resv7=0x{b.resv7:02x}, "
                                      "expected 0")
    deth = info.offset(Hdr.DETH)
    if deth is not None and b.buf[deth + 4]:  # parse drops DETH's resv8
        sink.add("RESERVED", p.frame, f"DETH reserved byte 0x{b.buf[deth + 4]:02x}, expected 0")
    if b.syndrome is not None and b.syndrome & 0x80:
        sink.add("RESERVED", p.frame, f"AETH syndrome 0x{b.syndrome:02x} has its reserved "
                                      "top bit set")
    if not info.has_payload and info.name != "CNP":
        if b.payload_len or b.pad:
            sink.add("NO-PAYLOAD", p.frame, f"{info.name} carries no payload, saw "
                                            f"{b.payload_len} bytes and pad {b.pad}")
        return
    if (b.payload_len + b.pad) % 4:
        # parse takes the pad from the BTH, so payload+pad is what follows the headers
        want = -b.payload_len & 3
        sink.add("PAD", p.frame, f"PadCnt {b.pad} leaves {b.payload_len + b.pad} bytes after "
                                 f"the headers, not a multiple of 4 (PadCnt {want} for "
                                 f"{b.payload_len} bytes)")
    elif b.pad and any(b.buf[b.payload_offset + b.payload_len:b.payload_offset + b.payload_len
                             + b.pad]):
        sink.add("PAD", p.frame, f"the {b.pad} pad bytes are not zero (rxe_req.c zeroes them)")
