"""Socket addresses for librdmacm's functions, and ``rdma_getaddrinfo``.

A ``struct sockaddr`` is read and written as bytes at the offsets Linux's ABI fixes
(``sa_family`` at 0, the port at 2, an IPv4 address at 4, an IPv6 one at 8): no part of
the library declares the socket structures to cffi (rsocket's part reads them too, and a
structure may be declared by one part only).

``rdma_getaddrinfo`` is librdmacm's (addrinfo.c): the hints become a ``getaddrinfo`` call
(``RAI_PASSIVE`` -> ``AI_PASSIVE``, the QP type the socket type, the port space the
protocol), the first answer becomes one ``struct rdma_addrinfo`` -- the source address for
a passive one, the destination otherwise, the hints' source address added -- and its
failure is getaddrinfo's ``EAI_*`` code, returned as librdmacm returns it. No route
records (``ai_route``): that needs ibacm, which a soft device has no use for.
"""

from __future__ import annotations

import socket
import struct
from ipaddress import IPv4Address, IPv6Address, ip_address
from typing import Any

from . import shim
from .shim import Errno, guard, handles

__all__ = ["IMPLEMENTS", "install", "AF_IB", "SOCKADDR_STORAGE", "sockaddr_len",
           "read_sockaddr", "write_sockaddr", "sockaddr_bytes", "sockaddr_port", "getaddrinfo"]

IMPLEMENTS = ("rdma_getaddrinfo", "rdma_freeaddrinfo")


AF_IB = 27
#: sizeof(struct sockaddr_storage): the room rdma_addr gives each address
SOCKADDR_STORAGE = 128
_LEN = {socket.AF_INET: 16, socket.AF_INET6: 28}

RAI_PASSIVE, RAI_NUMERICHOST = 0x1, 0x2
IBV_QPT_RC, IBV_QPT_UC, IBV_QPT_UD = 2, 3, 4
IBV_QPT_XRC_SEND, IBV_QPT_XRC_RECV = 9, 10
RDMA_PS_IPOIB, RDMA_PS_TCP, RDMA_PS_UDP, RDMA_PS_IB = 0x0002, 0x0106, 0x0111, 0x013F

IPAddress = IPv4Address | IPv6Address


def sockaddr_len(sa: Any) -> int:
    """librdmacm ``ucma_addrlen``: the size of the address ``sa`` points to, 0 for NULL or
    a family rdma_cm does not take (AF_IB too: no soft device has native IB
    addressing)."""
    if sa == shim.ffi.NULL:
        return 0
    fam = shim.ffi.cast("unsigned short *", sa)[0]
    return _LEN.get(fam, 0)


def read_sockaddr(sa: Any) -> tuple[int, IPAddress, int]:
    """(family, address, port) of a ``struct sockaddr *``; EINVAL if it is NULL or not
    AF_INET/AF_INET6."""
    n = sockaddr_len(sa)
    if not n:
        raise Errno(22, "not an AF_INET or AF_INET6 address")
    raw = bytes(shim.ffi.buffer(shim.ffi.cast("char *", sa), n))
    fam, port = struct.unpack_from("<H", raw)[0], struct.unpack_from(">H", raw, 2)[0]
    addr = IPv4Address(raw[4:8]) if fam == socket.AF_INET else IPv6Address(raw[8:24])
    return fam, addr, port


def sockaddr_bytes(ip: IPAddress | None, port: int, family: int | None = None) -> bytes:
    """A ``struct sockaddr_in``/``_in6`` for ``ip`` and ``port`` (None: the wildcard of
    ``family``); an IPv4 address in an AF_INET6 one is v4-mapped."""
    if family is None:
        family = socket.AF_INET6 if ip is not None and ip.version == 6 else socket.AF_INET
    if family == socket.AF_INET:
        packed = ip.packed if ip is not None else bytes(4)
        return struct.pack("<H", family) + struct.pack(">H", port) + packed + bytes(8)
    if ip is not None and ip.version == 4:
        ip = IPv6Address(b"\0" * 10 + b"\xff\xff" + ip.packed)
    packed = ip.packed if ip is not None else bytes(16)
    return (struct.pack("<H", family) + struct.pack(">H", port) + bytes(4) + packed
            + bytes(4))


def write_sockaddr(dst: Any, data: bytes, room: int = SOCKADDR_STORAGE) -> None:
    """Fill the ``room`` bytes at ``dst`` with the address ``data`` (zeros after it)."""
    shim.ffi.memmove(dst, data.ljust(room, b"\0"), room)


def sockaddr_port(sa: Any) -> int:
    """librdmacm ``ucma_get_port``: the port of ``sa`` as a ``__be16`` (its two bytes in
    network order read as a host integer), 0 for another family."""
    p = shim.ffi.cast("unsigned short *", sa)
    return int(p[1]) if p[0] in _LEN else 0


def _ai_hints(hints: Any) -> tuple[int, int, int, int]:
    """librdmacm ``ucma_convert_to_ai``: (family, socktype, proto, flags) for getaddrinfo."""
    flags = socket.AI_PASSIVE if hints.ai_flags & RAI_PASSIVE else 0
    if hints.ai_flags & RAI_NUMERICHOST:
        flags |= socket.AI_NUMERICHOST
    family = hints.ai_family if hints.ai_family != AF_IB else 0
    socktype = {IBV_QPT_RC: socket.SOCK_STREAM, IBV_QPT_UC: socket.SOCK_STREAM,
                IBV_QPT_XRC_SEND: socket.SOCK_STREAM, IBV_QPT_XRC_RECV: socket.SOCK_STREAM,
                IBV_QPT_UD: socket.SOCK_DGRAM}.get(hints.ai_qp_type, 0)
    ps = hints.ai_port_space
    proto = {RDMA_PS_TCP: socket.IPPROTO_TCP, RDMA_PS_IPOIB: socket.IPPROTO_UDP,
             RDMA_PS_UDP: socket.IPPROTO_UDP}.get(ps, 0)
    if ps == RDMA_PS_IB:
        proto = {socket.SOCK_STREAM: socket.IPPROTO_TCP,
                 socket.SOCK_DGRAM: socket.IPPROTO_UDP}.get(socktype, 0)
    return family, socktype, proto, flags


class _AddrInfo:
    """One ``struct rdma_addrinfo`` and the memory its pointers point into."""

    def __init__(self) -> None:
        ffi = shim.ffi
        self.struct = ffi.new("struct rdma_addrinfo *")
        self.keep: list[Any] = []

    def set_addr(self, which: str, data: bytes) -> None:
        buf = shim.ffi.new("char[]", data)
        self.keep.append(buf)
        setattr(self.struct, f"ai_{which}_addr", shim.ffi.cast("struct sockaddr *", buf))
        setattr(self.struct, f"ai_{which}_len", len(data))

    def set_name(self, which: str, name: str) -> None:
        buf = shim.ffi.new("char[]", name.encode())
        self.keep.append(buf)
        setattr(self.struct, f"ai_{which}_canonname", buf)


def getaddrinfo(node: Any, service: Any, hints: Any) -> tuple[int, Any]:
    """rdma_getaddrinfo in Python: (0, struct) or (EAI_* code, None)."""
    ffi = shim.ffi
    if node == ffi.NULL and service == ffi.NULL and hints == ffi.NULL:
        raise Errno(22, "rdma_getaddrinfo: no node, service or hints")
    h = hints if hints != ffi.NULL else ffi.new("struct rdma_addrinfo *")
    ai = _AddrInfo()
    r = ai.struct
    if node != ffi.NULL or service != ffi.NULL:
        family, socktype, proto, flags = _ai_hints(h) if hints != ffi.NULL else (0, 0, 0, 0)
        host = ffi.string(node).decode() if node != ffi.NULL else None
        serv = ffi.string(service).decode() if service != ffi.NULL else None
        try:
            found = socket.getaddrinfo(host, serv, family, socktype, proto, flags)
        except socket.gaierror as e:
            return int(e.errno), None
        fam, stype, prot, canon, sa = found[0]
        # ucma_convert_to_rai: the hints' QP type and port space win over the socket's
        r.ai_qp_type = h.ai_qp_type or {socket.SOCK_STREAM: IBV_QPT_RC,
                                        socket.SOCK_DGRAM: IBV_QPT_UD}.get(stype, 0)
        r.ai_port_space = h.ai_port_space or {socket.IPPROTO_TCP: RDMA_PS_TCP,
                                              socket.IPPROTO_UDP: RDMA_PS_UDP}.get(prot, 0)
        r.ai_family = fam
        data = sockaddr_bytes(ip_address(sa[0].split("%")[0]), sa[1], fam)
        if flags & socket.AI_PASSIVE:
            r.ai_flags = RAI_PASSIVE
            ai.set_addr("src", data)
            if canon:
                ai.set_name("src", canon)
        else:
            ai.set_addr("dst", data)
            if canon:
                ai.set_name("dst", canon)
    else:
        r.ai_flags, r.ai_family = h.ai_flags, h.ai_family
        r.ai_qp_type, r.ai_port_space = h.ai_qp_type, h.ai_port_space
        if h.ai_dst_len:
            ai.set_addr("dst", bytes(ffi.buffer(ffi.cast("char *", h.ai_dst_addr),
                                                h.ai_dst_len)))
    if not r.ai_src_len and h.ai_src_len:
        ai.set_addr("src", bytes(ffi.buffer(ffi.cast("char *", h.ai_src_addr), h.ai_src_len)))
    handles.add("addrinfo", r, ai)
    return 0, r


def install(ffi: Any, lib: Any) -> None:
    """Define this part's functions."""

    @ffi.def_extern(name="rdma_getaddrinfo")
    @guard(-1)
    def rdma_getaddrinfo(node: Any, service: Any, hints: Any, res: Any) -> int:
        if res == ffi.NULL:
            raise Errno(22, "rdma_getaddrinfo: res is NULL")
        code, r = getaddrinfo(node, service, hints)
        if code:
            return code  # getaddrinfo's EAI_* (negative), for gai_strerror, as librdmacm
        res[0] = r
        return 0

    @ffi.def_extern(name="rdma_freeaddrinfo")
    @guard(None)
    def rdma_freeaddrinfo(res: Any) -> None:
        while res != ffi.NULL:
            nxt = res.ai_next
            handles.release("addrinfo", res)
            res = nxt
