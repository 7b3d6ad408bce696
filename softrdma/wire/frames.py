"""Ethernet / IPv4 / IPv6 / UDP framing around RoCE packets, for pcap work.

``decode_frame`` peels a captured frame down to its UDP payload and remembers every
address field the ICRC covers; ``encode_frame`` wraps a RoCE packet the way rxe's
``prepare_ipv4_hdr``/``prepare_ipv6_hdr``/``prepare_udp_hdr`` do (IPv4 with DF, UDP
checksum 0, RoCEv2 destination port 4791) and can fill in its ICRC.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

from .headers import ROCE_V2_UDP_DPORT
from .icrc import (
    IP_DF, IPPROTO_UDP, IPV4_VER_IHL, icrc_from_ip_packet, icrc_ipv4, icrc_ipv6,
)

__all__ = [
    "FrameError", "Frame", "decode_frame", "encode_frame", "ip_checksum",
    "LINKTYPE_NULL", "LINKTYPE_ETHERNET", "LINKTYPE_RAW", "LINKTYPE_LINUX_SLL",
    "LINKTYPE_IPV4", "LINKTYPE_IPV6", "LINKTYPE_LINUX_SLL2", "ETH_P_IP", "ETH_P_IPV6",
]

LINKTYPE_NULL = 0  # BSD loopback: 4-byte host-order address family
LINKTYPE_ETHERNET = 1
LINKTYPE_RAW = 101  # bare IPv4 or IPv6
LINKTYPE_LINUX_SLL = 113  # tcpdump -i any (v1)
LINKTYPE_IPV4 = 228
LINKTYPE_IPV6 = 229
LINKTYPE_LINUX_SLL2 = 276
ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD
_VLAN_TPIDS = (0x8100, 0x88A8, 0x9100)

_ETH = struct.Struct("!6s6sH")
_IPV4 = struct.Struct("!BBHHHBBH4s4s")
_IPV6 = struct.Struct("!IHBB16s16s")
_UDP = struct.Struct("!HHHH")


class FrameError(ValueError):
    """A frame that claims to carry IP/UDP but is malformed."""


@dataclass(slots=True)
class Frame:
    """An IP/UDP datagram as captured. ``payload`` is the UDP payload (a memoryview);
    ``ip_packet`` runs from the IP header to the end of the UDP payload."""

    ip_version: int
    ip_src: bytes
    ip_dst: bytes
    sport: int
    dport: int
    payload: memoryview
    ip_packet: memoryview
    ip_id: int = 0
    ip_frag: int = 0
    tos: int = 0
    ttl: int = 0
    flow_label: int = 0
    udp_checksum: int = 0
    eth_src: bytes | None = None
    eth_dst: bytes | None = None
    vlan: int | None = None

    @property
    def src(self) -> str:
        return str(ipaddress.ip_address(self.ip_src))

    @property
    def dst(self) -> str:
        return str(ipaddress.ip_address(self.ip_dst))

    @property
    def is_roce(self) -> bool:
        return self.dport == ROCE_V2_UDP_DPORT

    def icrc(self) -> int:
        """The ICRC this datagram's RoCE payload should carry, from the captured headers."""
        return icrc_from_ip_packet(self.ip_packet)


def ip_checksum(hdr: bytes | bytearray | memoryview) -> int:
    """The Internet checksum of an IPv4 header (with its checksum field zeroed)."""
    if len(hdr) % 2:
        hdr = bytes(hdr) + b"\0"
    s = sum(struct.unpack(f"!{len(hdr) // 2}H", hdr))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def _ip_offset(buf: memoryview, linktype: int) -> tuple[int, int, bytes | None, bytes | None, int | None]:
    """Return (offset of the IP header, ethertype, eth src, eth dst, vlan) or ethertype -1."""
    if linktype == LINKTYPE_ETHERNET:
        if len(buf) < 14:
            raise FrameError(f"Ethernet frame of {len(buf)} bytes is truncated")
        dst, src, etype = _ETH.unpack_from(buf, 0)
        off = 14
        vlan = None
        while etype in _VLAN_TPIDS:
            if len(buf) < off + 4:
                raise FrameError("VLAN tag truncated")
            tci, etype = struct.unpack_from("!HH", buf, off)
            vlan = tci & 0xFFF
            off += 4
        return off, etype, src, dst, vlan
    if linktype in (LINKTYPE_RAW, LINKTYPE_IPV4, LINKTYPE_IPV6):
        if not len(buf):
            raise FrameError("empty raw IP frame")
        v = buf[0] >> 4
        return 0, {4: ETH_P_IP, 6: ETH_P_IPV6}.get(v, -1), None, None, None
    if linktype == LINKTYPE_LINUX_SLL:
        if len(buf) < 16:
            raise FrameError("Linux cooked (SLL) header truncated")
        (etype,) = struct.unpack_from("!H", buf, 14)
        return 16, etype, None, None, None
    if linktype == LINKTYPE_LINUX_SLL2:
        if len(buf) < 20:
            raise FrameError("Linux cooked (SLL2) header truncated")
        (etype,) = struct.unpack_from("!H", buf, 0)
        return 20, etype, None, None, None
    if linktype == LINKTYPE_NULL:
        if len(buf) < 4:
            raise FrameError("loopback header truncated")
        fam = int.from_bytes(buf[:4], "little")
        if fam > 0xFFFF:
            fam = int.from_bytes(buf[:4], "big")
        return 4, ETH_P_IP if fam == 2 else (ETH_P_IPV6 if fam in (10, 24, 28, 30) else -1), None, None, None
    return 0, -1, None, None, None


def decode_frame(data: bytes | bytearray | memoryview, linktype: int = LINKTYPE_ETHERNET) -> Frame | None:
    """Decode a captured frame down to UDP. Returns None when it is not IPv4/IPv6 + UDP
    (ARP, TCP, an unsupported link type...), raises :class:`FrameError` when it says it is
    but its headers do not hold together."""
    buf = memoryview(data)
    off, etype, esrc, edst, vlan = _ip_offset(buf, linktype)
    if etype == ETH_P_IP:
        if len(buf) < off + 20:
            raise FrameError("IPv4 header truncated")
        vihl, tos, tot, ident, frag, ttl, proto, _csum, src, dst = _IPV4.unpack_from(buf, off)
        if vihl >> 4 != 4:
            raise FrameError(f"IPv4 ethertype but IP version {vihl >> 4}")
        ihl = (vihl & 0xF) * 4
        if ihl < 20 or tot < ihl or len(buf) < off + tot:
            raise FrameError(f"IPv4 lengths inconsistent (ihl {ihl}, total {tot}, "
                             f"captured {len(buf) - off})")
        if proto != IPPROTO_UDP:
            return None
        if frag & 0x3FFF:
            return None  # a fragment: not a whole UDP datagram
        udp = off + ihl
        end = off + tot
        fl = 0
    elif etype == ETH_P_IPV6:
        if len(buf) < off + 40:
            raise FrameError("IPv6 header truncated")
        w0, plen, nh, hlim, src, dst = _IPV6.unpack_from(buf, off)
        if w0 >> 28 != 6:
            raise FrameError(f"IPv6 ethertype but IP version {w0 >> 28}")
        if nh != IPPROTO_UDP:
            return None  # extension headers are not used by RoCEv2
        tos = (w0 >> 20) & 0xFF
        fl = w0 & 0xFFFFF
        ttl = hlim
        ident = frag = 0
        udp = off + 40
        end = udp + plen
        if len(buf) < end:
            raise FrameError(f"IPv6 payload length {plen} exceeds the captured bytes")
    else:
        return None
    if end - udp < 8:
        raise FrameError("UDP header truncated")
    sport, dport, ulen, ucsum = _UDP.unpack_from(buf, udp)
    if ulen < 8 or udp + ulen > end:
        raise FrameError(f"UDP length {ulen} inconsistent with the IP packet")
    return Frame(ip_version=4 if etype == ETH_P_IP else 6, ip_src=bytes(src), ip_dst=bytes(dst),
                 sport=sport, dport=dport, payload=buf[udp + 8:udp + ulen],
                 ip_packet=buf[off:udp + ulen], ip_id=ident, ip_frag=frag, tos=tos, ttl=ttl,
                 flow_label=fl, udp_checksum=ucsum, eth_src=esrc, eth_dst=edst, vlan=vlan)


def encode_frame(
    roce: bytes | bytearray,
    *,
    src: str | bytes,
    dst: str | bytes,
    sport: int,
    dport: int = ROCE_V2_UDP_DPORT,
    ip_id: int = 0,
    ttl: int = 64,
    tos: int = 0,
    flow_label: int = 0,
    frag: int = IP_DF,
    eth_src: bytes = b"\x02\x00\x00\x00\x00\x01",
    eth_dst: bytes = b"\x02\x00\x00\x00\x00\x02",
    linktype: int = LINKTYPE_ETHERNET,
    fill_icrc: bool = True,
) -> bytes:
    """Wrap ``roce`` (BTH .. ICRC) in UDP, IPv4 or IPv6 (chosen by the address family) and,
    for ``LINKTYPE_ETHERNET``, Ethernet. With ``fill_icrc`` the ICRC is computed for the
    headers written here; otherwise the packet's bytes are kept as they are."""
    s = ipaddress.ip_address(src if isinstance(src, str) else bytes(src))
    d = ipaddress.ip_address(dst if isinstance(dst, str) else bytes(dst))
    if s.version != d.version:
        raise ValueError("source and destination must both be IPv4 or both IPv6")
    roce = bytearray(roce)
    n = len(roce)
    if fill_icrc:
        if s.version == 4:
            c = icrc_ipv4(roce, s.packed, d.packed, sport, dport, ip_id, frag)
        else:
            c = icrc_ipv6(roce, s.packed, d.packed, sport, dport)
        roce[-4:] = c.to_bytes(4, "little")
    udp = _UDP.pack(sport, dport, 8 + n, 0)
    if s.version == 4:
        hdr = bytearray(_IPV4.pack(IPV4_VER_IHL, tos, 28 + n, ip_id, frag, ttl, IPPROTO_UDP,
                                   0, s.packed, d.packed))
        hdr[10:12] = ip_checksum(hdr).to_bytes(2, "big")
        etype = ETH_P_IP
    else:
        hdr = bytearray(_IPV6.pack((6 << 28) | (tos << 20) | (flow_label & 0xFFFFF), 8 + n,
                                   IPPROTO_UDP, ttl, s.packed, d.packed))
        etype = ETH_P_IPV6
    ip = bytes(hdr) + udp + bytes(roce)
    if linktype == LINKTYPE_ETHERNET:
        return _ETH.pack(eth_dst, eth_src, etype) + ip
    if linktype in (LINKTYPE_RAW, LINKTYPE_IPV4, LINKTYPE_IPV6):
        return ip
    raise ValueError(f"encode_frame writes Ethernet or raw IP, not link type {linktype}")
