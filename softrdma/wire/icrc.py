"""The RoCEv2 invariant CRC (ICRC), computed exactly as rxe_icrc.c does.

The ICRC is a plain CRC-32 (the zlib/Ethernet polynomial, so ``zlib.crc32`` computes it
at C speed; softrdma.wire.crc uses ISA-L's faster one when installed) over::

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
captured (what a pcap or a raw socket has). The fast path caches the CRC state after the
pseudo-header per flow and packet shape (CRC-32 is linear, which keeps the per-packet IPv4
ID out of the cache key); ``icrc_ok_ipv4``/``icrc_ok_ipv6`` are the receive check, one
crc32 over the packet with its ICRC compared with a cached constant. docs/wire.md has the
reasoning; ``_icrc_ipv4_ref``/``_icrc_ipv6_ref`` are the plain definition the tests hold
both to.
"""

from __future__ import annotations

import struct

from .crc import crc32 as _crc32
from .headers import ROCE_V2_UDP_DPORT

__all__ = [
    "ICRC_SEED", "icrc_ipv4", "icrc_ipv6", "icrc_ipv4_iov", "icrc_ipv6_iov", "icrc_ok_ipv4", "icrc_ok_ipv6",
    "icrc_from_ip_packet", "set_icrc_ipv4", "set_icrc_ipv6", "IP_DF", "IPPROTO_UDP", "IPV4_VER_IHL",
    "RC_FLUSH_OPCODE", "rxe_flush_icrc", "rxe_flush_icrc_ok",
]

#: CRC-32 state after the eight 0xff bytes; rxe's 0xdebb20e3 is its complement.
ICRC_SEED = _crc32(b"\xff" * 8)
IP_DF = 0x4000  # IPv4 flags+fragment word: don't fragment, offset 0
IPPROTO_UDP = 17
IPV4_VER_IHL = 0x45  # IPv4 version 4, header of 5 words (no options), as rxe sends

# IPv4 header (masked) + UDP header (masked) + BTH words, with BTH byte 4 forced to 0xff.
_V4_PREFIX = struct.Struct("!BBHHHBBH4s4sHHHHIII")
_V6_PREFIX = struct.Struct("!IHBB16s16sHHHHIII")
_BTH3 = struct.Struct("!III")
# The cached part: IP and UDP headers (masked), BTH bytes 0..3 and the masked byte 4.
_V4_HEAD = struct.Struct("!BBHHHBBH4s4sHHHHIB")
_V6_HEAD = struct.Struct("!IHBB16s16sHHHHIB")
_bth_word0 = struct.Struct("!I").unpack_from

#: Bound of each cache below; on overflow it is emptied. A flow needs a handful of entries
#: (one per opcode and packet length in use); the bound is small because every entry is a
#: few Python objects (about ten blocks over the caches), and ``softrdma fuzz``, which
#: sends every length, counts allocated blocks to find leaks. A miss costs about what the
#: uncached definition does.
PREFIX_CACHE_MAX = 128
# (BTH word 0, length, src, dst, sport, dport, frag) -> CRC state after the IP and UDP
# headers and BTH bytes 0..4, with IP ID 0. Everything the ICRC covers before BTH byte 5
# is a function of these, so a packet costs one crc32 over BTH byte 5 .. pad instead of a
# struct pack, a crc32 of the pseudo-header and a crc32 of the rest.
_prefix4: dict[tuple, int] = {}
_prefix6: dict[tuple, int] = {}


def _xor_tables(after: int) -> tuple[list[int], list[int]]:
    """How a 16-bit field ``after`` + 2 bytes before the cached state changes that state.

    CRC-32 is linear: flipping bits of the input flips the state by an amount that depends
    only on the flipped bits and how many bytes follow them, whatever the rest of the input.
    So the state for IP ID ``x`` is the state for ID 0 xor ``hi[x >> 8] ^ lo[x & 0xff]``,
    which keeps the IP ID (a new one per packet from rxe) out of the cache key.
    """
    zero_hi, zero_lo = _crc32(bytes(after + 2), 0), _crc32(bytes(after + 1), 0)
    hi = [_crc32(bytes((b,)) + bytes(after + 1), 0) ^ zero_hi for b in range(256)]
    lo = [_crc32(bytes((b,)) + bytes(after), 0) ^ zero_lo for b in range(256)]
    return hi, lo


# The IPv4 ID is bytes 4..5 of the IP header; after it come 14 more IP header bytes, the
# 8 UDP header bytes and BTH bytes 0..4: 27 bytes.
_ID_HI, _ID_LO = _xor_tables(14 + 8 + 5)


def _prefix_v4(key: tuple) -> int:
    """Compute and cache the CRC state for ``key`` (see ``_prefix4``)."""
    w0, n, src, dst, sport, dport, frag = key
    head = _V4_HEAD.pack(IPV4_VER_IHL, 0xFF, 28 + n, 0, frag, 0xFF, IPPROTO_UDP, 0xFFFF,
                         src, dst, sport, dport, 8 + n, 0xFFFF, w0, 0xFF)
    if len(_prefix4) >= PREFIX_CACHE_MAX:
        _prefix4.clear()
    s = _prefix4[key] = _crc32(head, ICRC_SEED)
    return s


def _prefix_v6(key: tuple) -> int:
    w0, n, src, dst, sport, dport, next_header = key
    head = _V6_HEAD.pack(0x6FFFFFFF, 8 + n, next_header, 0xFF, src, dst, sport, dport,
                         8 + n, 0xFFFF, w0, 0xFF)
    if len(_prefix6) >= PREFIX_CACHE_MAX:
        _prefix6.clear()
    s = _prefix6[key] = _crc32(head, ICRC_SEED)
    return s


def icrc_ipv4(roce: bytes | bytearray | memoryview, src: bytes, dst: bytes, sport: int,
              dport: int = ROCE_V2_UDP_DPORT, ip_id: int = 0, frag: int = IP_DF) -> int:
    """ICRC of ``roce`` (BTH .. ICRC placeholder) carried in IPv4 without options.

    ``src``/``dst`` are the 4-byte addresses; ``frag`` is the flags + fragment offset word
    (rxe sends DF). The last four bytes of ``roce`` (the ICRC slot) are not read.

    The CRC state up to BTH byte 4 comes from a cache keyed by the first BTH word, the
    length and the addresses and ports, adjusted for ``ip_id`` by two table lookups; the
    bytes after it cost one ``crc32`` call (softrdma.wire.crc).
    """
    n = len(roce)
    if n < 16:  # shorter than BTH + ICRC: the plain definition, as for any input
        return _icrc_ipv4_ref(roce, src, dst, sport, dport, ip_id, frag)
    key = (_bth_word0(roce, 0)[0], n, src, dst, sport, dport, frag)
    try:  # a subscript costs less than .get(); misses are rare
        s = _prefix4[key]
    except KeyError:
        s = _prefix_v4(key)
    except TypeError:  # an unhashable address (a bytearray): no cache
        return _icrc_ipv4_ref(roce, src, dst, sport, dport, ip_id, frag)
    if ip_id:
        if not 0 < ip_id <= 0xFFFF:
            raise struct.error(f"IP ID {ip_id} is not a 16-bit value")
        s ^= _ID_HI[ip_id >> 8] ^ _ID_LO[ip_id & 0xFF]
    mv = roce if type(roce) is memoryview else memoryview(roce)
    return _crc32(mv[5:n - 4], s)


def icrc_ipv6(roce: bytes | bytearray | memoryview, src: bytes, dst: bytes, sport: int,
              dport: int = ROCE_V2_UDP_DPORT, next_header: int = IPPROTO_UDP) -> int:
    """ICRC of ``roce`` carried in IPv6 (no extension headers). ``src``/``dst``: 16 bytes.

    Cached like :func:`icrc_ipv4` (IPv6 has no ID).
    """
    n = len(roce)
    if n < 16:
        return _icrc_ipv6_ref(roce, src, dst, sport, dport, next_header)
    key = (_bth_word0(roce, 0)[0], n, src, dst, sport, dport, next_header)
    try:
        s = _prefix6[key]
    except KeyError:
        s = _prefix_v6(key)
    except TypeError:  # an unhashable address (a bytearray): no cache
        return _icrc_ipv6_ref(roce, src, dst, sport, dport, next_header)
    mv = roce if type(roce) is memoryview else memoryview(roce)
    return _crc32(mv[5:n - 4], s)


def icrc_ipv4_iov(parts: list, src: bytes, dst: bytes, sport: int,
                  dport: int = ROCE_V2_UDP_DPORT, ip_id: int = 0, frag: int = IP_DF) -> int:
    """:func:`icrc_ipv4` of a packet given as three buffers (softrdma.wire.iov: headers,
    payload, pad + ICRC slot), the payload read where it is: the CRC continued over each
    buffer in turn (CRC-32 carries its state from one call to the next), so the same value
    as over ``b"".join(parts)``. The ICRC slot is not read."""
    head, body, tail = parts
    t = len(tail)
    n = len(head) + len(body) + t
    if len(head) < 12 or t < 4:  # the BTH or the ICRC cut: the plain definition
        return icrc_ipv4(b"".join(parts), src, dst, sport, dport, ip_id, frag)
    key = (_bth_word0(head, 0)[0], n, src, dst, sport, dport, frag)
    try:
        s = _prefix4[key]
    except KeyError:
        s = _prefix_v4(key)
    except TypeError:  # an unhashable address: the plain definition
        return icrc_ipv4(b"".join(parts), src, dst, sport, dport, ip_id, frag)
    if ip_id:
        if not 0 < ip_id <= 0xFFFF:
            raise struct.error(f"IP ID {ip_id} is not a 16-bit value")
        s ^= _ID_HI[ip_id >> 8] ^ _ID_LO[ip_id & 0xFF]
    # the headers after BTH byte 4 as a slice (a few bytes: less than making a view)
    s = _crc32(body, _crc32(head[5:], s))
    return _crc32(tail[:t - 4], s) if t > 4 else s


def icrc_ipv6_iov(parts: list, src: bytes, dst: bytes, sport: int,
                  dport: int = ROCE_V2_UDP_DPORT, next_header: int = IPPROTO_UDP) -> int:
    """IPv6 counterpart of :func:`icrc_ipv4_iov`."""
    head, body, tail = parts
    t = len(tail)
    n = len(head) + len(body) + t
    if len(head) < 12 or t < 4:
        return icrc_ipv6(b"".join(parts), src, dst, sport, dport, next_header)
    key = (_bth_word0(head, 0)[0], n, src, dst, sport, dport, next_header)
    try:
        s = _prefix6[key]
    except KeyError:
        s = _prefix_v6(key)
    except TypeError:
        return icrc_ipv6(b"".join(parts), src, dst, sport, dport, next_header)
    s = _crc32(body, _crc32(head[5:], s))
    return _crc32(tail[:t - 4], s) if t > 4 else s


#: What CRC-32 leaves after running over a message followed by its own CRC (little-endian):
#: zlib.crc32(m + zlib.crc32(m, s).to_bytes(4, "little"), s) for any m and s.
CRC32_RESIDUE = 0x2144DF1C
# The state before the BTH (8 x 0xff, IP and UDP headers masked, IP ID 0), and what a
# crc32 from it over the whole received packet, ICRC included, gives when the ICRC is
# right; keyed by (length, BTH byte 4, src, dst, sport, dport, frag or next header).
# The two are stored as one int, state << 32 | expected: one object per entry.
_check4: dict[tuple, int] = {}
_check6: dict[tuple, int] = {}
# The IP ID's effect on the state before the BTH: 14 IP header and 8 UDP bytes follow it.
_ID_HI_PRE, _ID_LO_PRE = _xor_tables(14 + 8)


_ZEROS = memoryview(bytes(1 << 16))
# (length, BTH byte 4) -> the expected value; shared by all flows, so a new flow with
# lengths seen before costs no CRC run beyond its pseudo-header.
_expect: dict[tuple[int, int], int] = {}


def _expected(n: int, b4: int) -> int:
    """crc32 of an ``n``-byte packet with a right ICRC and BTH byte 4 ``b4``, over all of it.

    With byte 4 at its masked value 0xff the answer is the residue; a different byte 4
    flips it by the CRC of that difference followed by n - 5 zero bytes (linearity),
    computed from the state 0xffffffff (a zero register, which leading zero bytes keep)."""
    e = _expect.get((n, b4))
    if e is None:
        zeros = _ZEROS[:n - 5] if n - 5 <= len(_ZEROS) else bytes(n - 5)
        flip = _crc32(zeros, _crc32(bytes((b4 ^ 0xFF,)), 0xFFFFFFFF)) ^ 0xFFFFFFFF
        if len(_expect) >= PREFIX_CACHE_MAX:
            _expect.clear()
        e = _expect[(n, b4)] = CRC32_RESIDUE ^ flip
    return e


def _check_v4(key: tuple) -> int:
    """Compute and cache ``state before the BTH << 32 | expected crc32`` for ``key``."""
    n, b4, src, dst, sport, dport, frag = key
    head = _V4_HEAD.pack(IPV4_VER_IHL, 0xFF, 28 + n, 0, frag, 0xFF, IPPROTO_UDP, 0xFFFF,
                         src, dst, sport, dport, 8 + n, 0xFFFF, 0, 0)[:28]
    if len(_check4) >= PREFIX_CACHE_MAX:
        _check4.clear()
    v = _check4[key] = _crc32(head, ICRC_SEED) << 32 | _expected(n, b4)
    return v


def _check_v6(key: tuple) -> int:
    n, b4, src, dst, sport, dport, next_header = key
    head = _V6_HEAD.pack(0x6FFFFFFF, 8 + n, next_header, 0xFF, src, dst, sport, dport,
                         8 + n, 0xFFFF, 0, 0)[:48]
    if len(_check6) >= PREFIX_CACHE_MAX:
        _check6.clear()
    v = _check6[key] = _crc32(head, ICRC_SEED) << 32 | _expected(n, b4)
    return v


def icrc_ok_ipv4(roce: bytes | bytearray | memoryview, src: bytes, dst: bytes, sport: int,
                 dport: int = ROCE_V2_UDP_DPORT, ip_id: int = 0, frag: int = IP_DF) -> bool:
    """Whether the ICRC in the last four bytes of ``roce`` is right (the receive check).

    The same answer as ``icrc_ipv4(...) == int.from_bytes(roce[-4:], "little")`` for
    packets of at least BTH + ICRC, for less work: one crc32 over the whole buffer (no
    slice, no reading of the ICRC) from a cached state, compared with a cached value.
    """
    n = len(roce)
    if n < 16:
        return _icrc_ipv4_ref(roce, src, dst, sport, dport, ip_id, frag) == \
            int.from_bytes(roce[n - 4:], "little")
    key = (n, roce[4], src, dst, sport, dport, frag)
    try:  # a subscript costs less than .get(); misses are rare
        v = _check4[key]
    except KeyError:
        v = _check_v4(key)
    except TypeError:  # an unhashable address (a bytearray): no cache
        return _icrc_ipv4_ref(roce, src, dst, sport, dport, ip_id, frag) == \
            int.from_bytes(roce[n - 4:], "little")
    s = v >> 32
    if ip_id:
        if not 0 < ip_id <= 0xFFFF:
            raise struct.error(f"IP ID {ip_id} is not a 16-bit value")
        s ^= _ID_HI_PRE[ip_id >> 8] ^ _ID_LO_PRE[ip_id & 0xFF]
    return _crc32(roce, s) == v & 0xFFFFFFFF


def icrc_ok_ipv6(roce: bytes | bytearray | memoryview, src: bytes, dst: bytes, sport: int,
                 dport: int = ROCE_V2_UDP_DPORT, next_header: int = IPPROTO_UDP) -> bool:
    """IPv6 counterpart of :func:`icrc_ok_ipv4`."""
    n = len(roce)
    if n < 16:
        return _icrc_ipv6_ref(roce, src, dst, sport, dport, next_header) == \
            int.from_bytes(roce[n - 4:], "little")
    key = (n, roce[4], src, dst, sport, dport, next_header)
    try:
        v = _check6[key]
    except KeyError:
        v = _check_v6(key)
    except TypeError:
        return _icrc_ipv6_ref(roce, src, dst, sport, dport, next_header) == \
            int.from_bytes(roce[n - 4:], "little")
    return _crc32(roce, v >> 32) == v & 0xFFFFFFFF


def _icrc_ipv4_ref(roce: bytes | bytearray | memoryview, src: bytes, dst: bytes, sport: int,
                   dport: int = ROCE_V2_UDP_DPORT, ip_id: int = 0, frag: int = IP_DF) -> int:
    """The ICRC straight from its definition, no cache: the reference the tests hold the
    cached path to, and the path for inputs shorter than BTH + ICRC."""
    n = len(roce)
    w0, w1, w2 = _BTH3.unpack_from(roce, 0)
    prefix = _V4_PREFIX.pack(IPV4_VER_IHL, 0xFF, 28 + n, ip_id, frag, 0xFF, IPPROTO_UDP,
                             0xFFFF, src, dst, sport, dport, 8 + n, 0xFFFF, w0,
                             w1 | 0xFF000000, w2)
    return _crc32(memoryview(roce)[12:n - 4], _crc32(prefix, ICRC_SEED))


def _icrc_ipv6_ref(roce: bytes | bytearray | memoryview, src: bytes, dst: bytes, sport: int,
                   dport: int = ROCE_V2_UDP_DPORT, next_header: int = IPPROTO_UDP) -> int:
    """IPv6 counterpart of :func:`_icrc_ipv4_ref`."""
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


# ---- rxe's ICRC of a FLUSH -------------------------------------------------------------
#: BTH opcode of RC FLUSH (IBTA 1.5 annex A19); a plain int for the per-packet test
RC_FLUSH_OPCODE = 0x1C


def rxe_flush_icrc(icrc: int, roce: bytes | bytearray | memoryview) -> int:
    """The ICRC Linux rxe (6.2 and later, 6.12 included) puts on and expects of a FLUSH,
    from the IBTA one, ``icrc``.

    rxe's opcode table (rxe_opcode.c) gives RC_FLUSH no ``RXE_PAYLOAD`` offset, so
    ``payload_addr()`` is the BTH and ``payload_size()`` everything before the ICRC: after
    the headers, rxe_icrc.c runs the CRC once more over BTH, FETH and RETH as they are
    (the BTH unmasked). CRC-32 continues from a previous result, so that is one more
    crc32 over those bytes. A FLUSH with the IBTA ICRC is dropped by rxe as an ICRC error
    (seen against 6.12.117: its rcvd_pkts stays 0), which is why softrdma sends this one
    and accepts both (docs/wire.md)."""
    n = len(roce)
    mv = roce if type(roce) is memoryview else memoryview(roce)
    return _crc32(mv[:n - 4], icrc)


def rxe_flush_icrc_ok(roce: bytes | bytearray | memoryview, icrc: int) -> bool:
    """Whether ``roce`` (a FLUSH, ICRC in its last four bytes) carries rxe's ICRC, given
    the IBTA ICRC ``icrc`` of the same bytes."""
    return rxe_flush_icrc(icrc, roce) == int.from_bytes(roce[len(roce) - 4:], "little")
