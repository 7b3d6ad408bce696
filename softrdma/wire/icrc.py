"""The RoCEv2 invariant CRC (ICRC), computed exactly as rxe_icrc.c does.

The ICRC is a plain CRC-32 (the zlib/Ethernet polynomial, so ``zlib.crc32`` computes it
at C speed) over::

    8 bytes of 0xff (stands for the masked LRH of native InfiniBand)
    IP header  with the fields that may change in flight masked to all ones:
               IPv4 TOS, TTL, header checksum / IPv6 traffic class, flow label, hop limit
    UDP header with the checksum masked to all ones
    BTH        with byte 4 (FECN, BECN, resv6) masked to all ones
    extension headers, payload and pad, verbatim

and is stored after the pad as the little-endian bytes of that CRC. Everything not masked
is covered, including the IPv4 identification field: a receiver can check the ICRC of an
IPv4 packet only if it knows the IP ID it was sent with (see docs/wire.md).

Two interfaces: the ``icrc_ipv4``/``icrc_ipv6`` fast path takes the address fields and the
RoCE bytes (what a UDP socket knows), and ``icrc_from_ip_packet`` takes a whole IP packet as
captured (what a pcap or a raw socket has).
"""

from __future__ import annotations

import struct
import zlib

from .headers import ROCE_V2_UDP_DPORT

__all__ = [
    "ICRC_SEED", "icrc_ipv4", "icrc_ipv6", "icrc_from_ip_packet",
    "set_icrc_ipv4", "set_icrc_ipv6", "IP_DF", "IPPROTO_UDP", "IPV4_VER_IHL",
]

#: CRC-32 state after the eight 0xff bytes; rxe's 0xdebb20e3 is its complement.
ICRC_SEED = zlib.crc32(b"\xff" * 8)
IP_DF = 0x4000  # IPv4 flags+fragment word: don't fragment, offset 0
IPPROTO_UDP = 17
IPV4_VER_IHL = 0x45  # IPv4 version 4, header of 5 words (no options), as rxe sends

_crc32 = zlib.crc32
# IPv4 header (masked) + UDP header (masked) + BTH words, with BTH byte 4 forced to 0xff.
_V4_PREFIX = struct.Struct("!BBHHHBBH4s4sHHHHIII")
_V6_PREFIX = struct.Struct("!IHBB16s16sHHHHIII")
_BTH3 = struct.Struct("!III")


def icrc_ipv4(roce: bytes | bytearray | memoryview, src: bytes, dst: bytes, sport: int,
              dport: int = ROCE_V2_UDP_DPORT, ip_id: int = 0, frag: int = IP_DF) -> int:
    """ICRC of ``roce`` (BTH .. ICRC placeholder) carried in IPv4 without options.

    ``src``/``dst`` are the 4-byte addresses; ``frag`` is the flags + fragment offset word
    (rxe sends DF). The last four bytes of ``roce`` (the ICRC slot) are not read.
    """
    n = len(roce)
    w0, w1, w2 = _BTH3.unpack_from(roce, 0)
    prefix = _V4_PREFIX.pack(IPV4_VER_IHL, 0xFF, 28 + n, ip_id, frag, 0xFF, IPPROTO_UDP,
                             0xFFFF, src, dst, sport, dport, 8 + n, 0xFFFF, w0,
                             w1 | 0xFF000000, w2)
    return _crc32(memoryview(roce)[12:n - 4], _crc32(prefix, ICRC_SEED))


def icrc_ipv6(roce: bytes | bytearray | memoryview, src: bytes, dst: bytes, sport: int,
              dport: int = ROCE_V2_UDP_DPORT, next_header: int = IPPROTO_UDP) -> int:
    """ICRC of ``roce`` carried in IPv6 (no extension headers). ``src``/``dst``: 16 bytes."""
    n = len(roce)
    w0, w1, w2 = _BTH3.unpack_from(roce, 0)
    prefix = _V6_PREFIX.pack(0x6FFFFFFF, 8 + n, next_header, 0xFF, src, dst, sport, dport,
                             8 + n, 0xFFFF, w0, w1 | 0xFF000000, w2)
    return _crc32(memoryview(roce)[12:n - 4], _crc32(prefix, ICRC_SEED))


def set_icrc_ipv4(roce: bytearray | memoryview, src: bytes, dst: bytes, sport: int,
                  dport: int = ROCE_V2_UDP_DPORT, ip_id: int = 0, frag: int = IP_DF) -> int:
    """Compute and store the ICRC into the last four bytes of ``roce``; return it."""
    c = icrc_ipv4(roce, src, dst, sport, dport, ip_id, frag)
    roce[-4:] = c.to_bytes(4, "little")
    return c


def set_icrc_ipv6(roce: bytearray | memoryview, src: bytes, dst: bytes, sport: int,
                  dport: int = ROCE_V2_UDP_DPORT) -> int:
    c = icrc_ipv6(roce, src, dst, sport, dport)
    roce[-4:] = c.to_bytes(4, "little")
    return c


def icrc_from_ip_packet(ip: bytes | bytearray | memoryview) -> int:
    """ICRC of a whole IP packet (IPv4 with any options, or IPv6) as it was captured.

    ``ip`` runs from the first byte of the IP header to the end of the ICRC; the UDP
    payload must start with the BTH. Raises ValueError for anything that is not IPv4/IPv6.
    """
    b = bytearray(ip[:len(ip) - 4])
    if len(b) < 1:
        raise ValueError("empty IP packet")
    ver = b[0] >> 4
    if ver == 4:
        udp = (b[0] & 0xF) * 4
        if udp < 20 or len(b) < udp + 8 + 12:
            raise ValueError("IPv4 packet too short for UDP and BTH")
        b[1] = 0xFF  # TOS
        b[8] = 0xFF  # TTL
        b[10] = b[11] = 0xFF  # header checksum
    elif ver == 6:
        udp = 40
        if len(b) < udp + 8 + 12:
            raise ValueError("IPv6 packet too short for UDP and BTH")
        b[0] |= 0x0F  # traffic class (low nibble of byte 0 ..)
        b[1] = b[2] = b[3] = 0xFF  # .. traffic class and flow label
        b[7] = 0xFF  # hop limit
    else:
        raise ValueError(f"IP version {ver} is neither 4 nor 6")
    b[udp + 6] = b[udp + 7] = 0xFF  # UDP checksum
    b[udp + 8 + 4] = 0xFF  # BTH FECN, BECN, resv6
    return _crc32(b, ICRC_SEED)
