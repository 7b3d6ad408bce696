"""What rdma_cm adds on the wire: the service ID's port space and port, and the 36-byte
cma header at the start of REQ and SIDR_REQ private data.

**Service ID.** rdma_cm maps an IP port space and port to an IB service ID as
``(ps << 16) | port`` (``rdma_get_service_id`` in drivers/infiniband/core/cma.c): TCP port
7471 is 0x0000000001061d2f. The passive side splits it back the same way
(``rdma_ps_from_service_id``, ``cma_port_from_service_id``).

**cma header** (``struct cma_hdr`` in cma.c), 36 bytes, big-endian::

     0        1        2        3
    +--------+--------+--------+--------+
    |version |IPv|rsv |  source port    |   0   version 0; IP version 4 or 6 in bits 7..4
    +--------+--------+-----------------+
    |     source address (16 bytes)     |   4   IPv4: 12 zero bytes, then the address
    +-----------------------------------+
    |  destination address (16 bytes)   |  20
    +-----------------------------------+

The source is the active side (its ephemeral port and IP), the destination the address it
connects to; the destination port is the service ID's. User private data follows at byte
36, so a REQ carries at most 56 bytes of it and a SIDR_REQ 180. REP, REJ, RTU, DREQ, DREP
and SIDR_REP private data have no header.

    >>> h = CmaHeader(src=ip_address("10.77.0.12"), dst=ip_address("10.77.0.11"), sport=55128)
    >>> raw = h.pack(); len(raw), raw[:4].hex(), CmaHeader.unpack(raw) == h
    (36, '0040d758', True)
    >>> hex(service_id(PortSpace.TCP, 7471)), split_service_id(0x01061d2f)
    ('0x1061d2f', (<PortSpace.TCP: 262>, 7471))
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address

from ..wire.headers import Field
from .layout import Layout
from .messages import REQ, SIDR_REQ

__all__ = [
    "PortSpace", "service_id", "split_service_id", "format_service_id", "CMA_VERSION",
    "CMA_HDR_SIZE", "CMA_HEADER", "CmaHeader", "CmaError", "REQ_USER_DATA_SIZE",
    "SIDR_REQ_USER_DATA_SIZE", "cma_private_data", "split_cma_private_data", "gid_from_ip",
    "ip_from_gid", "ip_address",
]


class PortSpace(enum.IntEnum):
    """rdma_cm port spaces (``enum rdma_ucm_port_space``, librdmacm rdma_cma.h)."""

    IPOIB = 0x0002
    TCP = 0x0106  # RC
    UDP = 0x0111  # UD, resolved with SIDR
    IB = 0x013F  # RC or UD, chosen by the QP type


_PS_MASK = 0xFFFF_FFFF_FFFF_0000


def service_id(ps: int, port: int) -> int:
    """The service ID rdma_cm uses for a port space and port."""
    if not 0 <= ps <= 0xFFFF or not 0 <= port <= 0xFFFF:
        raise ValueError("the port space and the port are 16-bit values")
    return (ps << 16) | port


def split_service_id(sid: int) -> tuple[PortSpace | int, int]:
    """``(port space, port)`` of a service ID, as the passive side reads it (an unknown
    port space stays an int)."""
    ps = (sid >> 16) & 0xFFFF
    try:
        ps = PortSpace(ps)
    except ValueError:
        pass
    return ps, sid & 0xFFFF


def format_service_id(sid: int) -> str:
    """``TCP:7471`` for an rdma_cm service ID; the hex ID for anything else (one whose top
    32 bits are set, or whose port space rdma_cm does not define)."""
    ps, port = split_service_id(sid)
    if sid >> 32 == 0 and isinstance(ps, PortSpace):
        return f"{ps.name}:{port}"
    return f"0x{sid:016x}"


CMA_VERSION = 0x00
CMA_HDR_SIZE = 36
REQ_USER_DATA_SIZE = REQ.private_data_size - CMA_HDR_SIZE  # 56
SIDR_REQ_USER_DATA_SIZE = SIDR_REQ.private_data_size - CMA_HDR_SIZE  # 180

#: The cma header, described once (like the CM messages).
CMA_HEADER = Layout("cma_hdr", "!BBH16s16s", (
    Field("cma_version", 8, "cma header version: 0", attr="cma_version"),
    Field("ip_version", 4, "4 or 6", attr="ip_version"),
    Field("resv", 4, "reserved"),
    Field("port", 16, "the active side's (source) port", attr="port"),
    Field("src_addr", 128, "the active side's IP (IPv4: 12 zero bytes first)",
          attr="src_addr"),
    Field("dst_addr", 128, "the IP the active side connects to", attr="dst_addr"),
))


class CmaError(ValueError):
    """A cma header rdma_cm would refuse (the passive side answers it with REJ 28)."""


def _addr_bytes(a: IPv4Address | IPv6Address) -> bytes:
    return bytes(12) + a.packed if a.version == 4 else a.packed


@dataclass(frozen=True, slots=True)
class CmaHeader:
    """A cma header: ``src``/``dst`` addresses of one family and the source port."""

    src: IPv4Address | IPv6Address
    dst: IPv4Address | IPv6Address
    sport: int
    version: int = CMA_VERSION

    def __post_init__(self) -> None:
        if self.src.version != self.dst.version:
            raise CmaError("the cma header's addresses must be of one family")

    @property
    def ip_version(self) -> int:
        return self.src.version

    def pack(self) -> bytes:
        out = bytearray(CMA_HDR_SIZE)
        CMA_HEADER.pack_into(out, 0, {"cma_version": self.version,
                                      "ip_version": self.ip_version, "port": self.sport,
                                      "src_addr": _addr_bytes(self.src),
                                      "dst_addr": _addr_bytes(self.dst)})
        return bytes(out)

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview) -> "CmaHeader":
        """Decode the first 36 bytes of ``buf``. :class:`CmaError` for what rdma_cm's
        passive side refuses in cma.c: a version other than 0, an IP version other
        than 4 and 6."""
        if len(buf) < CMA_HDR_SIZE:
            raise CmaError(f"a cma header is {CMA_HDR_SIZE} bytes, got {len(buf)}")
        v = CMA_HEADER.unpack_from(buf)
        if v["cma_version"] != CMA_VERSION:
            raise CmaError(f"cma header version {v['cma_version']}, not {CMA_VERSION}")
        if v["ip_version"] == 4:
            src, dst = (IPv4Address(v[k][12:]) for k in ("src_addr", "dst_addr"))
        elif v["ip_version"] == 6:
            src, dst = (IPv6Address(v[k]) for k in ("src_addr", "dst_addr"))
        else:
            raise CmaError(f"cma header IP version {v['ip_version']}, not 4 or 6")
        return cls(src, dst, v["port"], v["cma_version"])  # type: ignore[arg-type]


def cma_private_data(hdr: CmaHeader, user_data: bytes | bytearray = b"",
                     size: int = REQ.private_data_size) -> bytes:
    """REQ (or, with ``size=SIDR_REQ.private_data_size``, SIDR_REQ) private data: the
    header, then the user's bytes."""
    if CMA_HDR_SIZE + len(user_data) > size:
        raise ValueError(f"at most {size - CMA_HDR_SIZE} bytes of user private data fit, "
                         f"got {len(user_data)}")
    return hdr.pack() + bytes(user_data)


def split_cma_private_data(private_data: bytes | bytearray | memoryview
                           ) -> tuple[CmaHeader, bytes]:
    """``(header, user data)`` of REQ or SIDR_REQ private data."""
    return CmaHeader.unpack(private_data), bytes(private_data[CMA_HDR_SIZE:])


_V4_MAPPED = bytes(10) + b"\xff\xff"


def gid_from_ip(addr: str | IPv4Address | IPv6Address) -> bytes:
    """The RoCEv2 GID of an IP address: IPv4 as ``::ffff:a.b.c.d``, IPv6 as itself."""
    a = ip_address(addr) if isinstance(addr, str) else addr
    return _V4_MAPPED + a.packed if a.version == 4 else a.packed


def ip_from_gid(gid: bytes) -> IPv4Address | IPv6Address:
    """The IP address a RoCEv2 GID stands for (the inverse of :func:`gid_from_ip`)."""
    if len(gid) != 16:
        raise ValueError("a GID is 16 bytes")
    return IPv4Address(gid[12:]) if gid[:12] == _V4_MAPPED else IPv6Address(gid)
