"""softrdma.wire: the stateless RoCEv2 wire layer.

Bytes in, fields out, and back: the header descriptions and named wire values
(:mod:`.headers`), the opcode table (:mod:`.opcodes`), packet parse/build (:mod:`.packet`),
the ICRC (:mod:`.icrc`), Ethernet/IP/UDP framing (:mod:`.frames`), pcap I/O (:mod:`.pcap`)
and the dissector (:mod:`.dissect`). Scapy layers live in :mod:`.scapy_layers` (imported on
demand, since scapy is optional). Nothing here keeps state, opens sockets or reads a clock
(a :class:`PcapWriter` record is stamped with the time its caller passes).
"""

from .headers import (
    AETH_ACK_UNLIMITED, DEFAULT_PKEY, GSI_QKEY, HEADERS, PSN_MASK, QPN_MASK,
    ROCE_V2_UDP_DPORT, AethType, Field, Header, NakCode, aeth_syndrome_name, aeth_type,
    aeth_value, make_syndrome,
)
from .icrc import icrc_from_ip_packet, icrc_ipv4, icrc_ipv6, set_icrc_ipv4, set_icrc_ipv6
from .frames import Frame, FrameError, decode_frame, encode_frame
from .opcodes import OPCODES, Hdr, Opcode, OpInfo, Transport, lookup
from .packet import DecodeError, RocePacket, build, parse
from .pcap import PcapError, PcapRecord, PcapWriter, read_pcap

__all__ = [
    "AETH_ACK_UNLIMITED", "DEFAULT_PKEY", "GSI_QKEY", "HEADERS", "PSN_MASK", "QPN_MASK",
    "ROCE_V2_UDP_DPORT", "AethType", "Field", "Header", "NakCode", "aeth_syndrome_name",
    "aeth_type", "aeth_value", "make_syndrome",
    "icrc_from_ip_packet", "icrc_ipv4", "icrc_ipv6", "set_icrc_ipv4", "set_icrc_ipv6",
    "Frame", "FrameError", "decode_frame", "encode_frame",
    "OPCODES", "Hdr", "Opcode", "OpInfo", "Transport", "lookup",
    "DecodeError", "RocePacket", "build", "parse",
    "PcapError", "PcapRecord", "PcapWriter", "read_pcap",
]
