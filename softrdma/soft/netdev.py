"""What a soft device learns from the network interface it is made for: MAC, MTU, addresses.

rxe takes these from the netdev it is attached to; softrdma takes them from the interface
that holds the device's IP address (Linux ``/sys/class/net`` and ``/proc/net``), or from
explicit arguments. Nothing here sends packets.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import functools
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass, field

__all__ = ["NetdevInfo", "netdev_for_ip", "interface_of", "eui64_link_local",
           "ipv4_mapped_gid", "IFF_UP"]

_SIOCGIFADDR = 0x8915
IFF_UP = 0x1  # <net/if.h>: the interface is up (`ip link set ... up`)


@dataclass
class NetdevInfo:
    ifname: str | None
    mac: bytes
    mtu: int
    ipv4: list[str] = field(default_factory=list)
    ipv6: list[str] = field(default_factory=list)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _ipv4_of(ifname: str) -> str | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        return socket.inet_ntoa(res[20:24])
    except OSError:
        return None
    finally:
        s.close()


def _ipv6_of(ifname: str) -> list[str]:
    out = []
    text = _read("/proc/net/if_inet6") or ""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[5] == ifname:
            out.append(str(ipaddress.IPv6Address(bytes.fromhex(parts[0]))))
    return out


def _interfaces() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/net"))
    except OSError:
        return [name for _, name in socket.if_nameindex()]


class _Ifaddrs(ctypes.Structure):
    pass


# <ifaddrs.h>: the part read here (ifa_ifu and ifa_data follow, unread)
_Ifaddrs._fields_ = [("ifa_next", ctypes.POINTER(_Ifaddrs)), ("ifa_name", ctypes.c_char_p),
                     ("ifa_flags", ctypes.c_uint), ("ifa_addr", ctypes.c_void_p)]


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def interface_of(ip: str) -> tuple[str, int] | None:
    """(interface name, ``IFF_*`` flags) of the interface holding ``ip``, from libc's
    ``getifaddrs`` (every address, secondary IPv4 ones included, which ``SIOCGIFADDR``
    does not show; a label such as ``eth0:1`` names its interface ``eth0``); None when
    no interface holds it."""
    addr = ipaddress.ip_address(ip)
    fam, off = (socket.AF_INET, 4) if addr.version == 4 else (socket.AF_INET6, 8)
    libc = _libc()
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        return None
    try:
        p = head
        while p:
            ifa = p.contents
            if ifa.ifa_addr and ctypes.c_ushort.from_address(ifa.ifa_addr).value == fam:
                raw = ctypes.string_at(ifa.ifa_addr + off, len(addr.packed))
                if raw == addr.packed:
                    return ifa.ifa_name.decode().split(":")[0], int(ifa.ifa_flags)
            p = ifa.ifa_next
        return None
    finally:
        libc.freeifaddrs(head)


def netdev_for_ip(ip: str) -> NetdevInfo:
    """Describe the interface holding ``ip``. Loopback addresses (all of 127/8 and ::1)
    belong to ``lo``. An address no interface holds gives ifname None, a locally
    administered MAC derived from the address, and MTU 1500."""
    addr = ipaddress.ip_address(ip)
    for name in _interfaces():
        v4 = _ipv4_of(name)
        v6 = _ipv6_of(name)
        owns = (addr.version == 4 and (v4 == ip or (addr.is_loopback and name == "lo"))) or \
               (addr.version == 6 and (ip in v6 or (addr.is_loopback and name == "lo")))
        if owns:
            mac_s = _read(f"/sys/class/net/{name}/address") or "00:00:00:00:00:00"
            mtu = int(_read(f"/sys/class/net/{name}/mtu") or 1500)
            mac = bytes.fromhex(mac_s.replace(":", ""))
            if mac == bytes(6):
                mac = _derived_mac(addr)
            return NetdevInfo(name, mac, mtu, [v4] if v4 else [], v6)
    held = interface_of(ip) if not addr.is_loopback else None
    if held is not None:  # a secondary IPv4 address: its interface's MAC and MTU
        mac = bytes.fromhex((_read(f"/sys/class/net/{held[0]}/address") or "").replace(":", ""))
        mtu = int(_read(f"/sys/class/net/{held[0]}/mtu") or 1500)
        return NetdevInfo(held[0], mac if len(mac) == 6 and any(mac) else _derived_mac(addr),
                          mtu, [ip] if addr.version == 4 else [], _ipv6_of(held[0]))
    return NetdevInfo(None, _derived_mac(addr), 1500)


def _derived_mac(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bytes:
    # Locally administered unicast MAC made from the address, so GIDs are stable per address.
    return b"\x02\x00" + addr.packed[-4:]


def eui64_link_local(mac: bytes) -> bytes:
    """fe80::/64 with the modified EUI-64 interface ID of ``mac`` (GID index 0 on RoCE)."""
    eui = bytes([mac[0] ^ 0x02]) + mac[1:3] + b"\xff\xfe" + mac[3:6]
    return b"\xfe\x80" + bytes(6) + eui


def ipv4_mapped_gid(ip: str) -> bytes:
    """::ffff:a.b.c.d, the RoCEv2 GID of an IPv4 address."""
    return bytes(10) + b"\xff\xff" + ipaddress.IPv4Address(ip).packed
