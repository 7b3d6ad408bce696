"""Addresses and routes for rdma_cm: which soft device an IP address names, which one a
destination is reached from, and the RoCE path (what the kernel's ``addr.c`` and cma.c's
``cma_resolve_iboe_route`` work out).

On RoCE there is no SA: the path is made locally from IP-mapped GIDs, the port's MTU,
hop limit 64, packet lifetime 18 and the flow label ``(sport * 31 + dport) & 0xFFFFF``
that decides the RC UDP source port (:class:`Route`, :func:`flow_label`).

**Interface devices.** An rxe device is there on its netdev, so a program that names only
the remote address finds it. softrdma makes the same device when rdma_cm needs one
(:func:`interface_device`): ``softrdma-<IP>`` on a non-loopback address of an UP
interface that is the route's source for a destination (``rdma_resolve_addr``) or that a
program binds to (``rdma_bind_addr``). ``SOFTRDMA_AUTO_DEVICES=0`` turns this off.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address
from typing import Any

from ..errors import PyverbsRDMAError
from ..soft.netdev import IFF_UP, interface_of
from ..verbs_api.device import (
    add_device, device_name_for, find_device, soft_devices, unregister_device,
)
from .device import CmaDevice

__all__ = ["Route", "flow_label", "device_for_ip", "device_for_dst", "route_source",
           "interface_device", "auto_devices", "NoDevice", "parse_ip", "check_port",
           "soft_devices", "HOP_LIMIT", "CMA_IBOE_PACKET_LIFETIME", "AUTO_DEVICES_ENV"]

log = logging.getLogger("softrdma")

IPAddress = IPv4Address | IPv6Address

#: RoCE's packet lifetime (cma.c CMA_IBOE_PACKET_LIFETIME) and the path's hop limit
CMA_IBOE_PACKET_LIFETIME = 18
HOP_LIMIT = 64


@dataclass
class Route:
    """``struct rdma_route`` on RoCE: the path a connection uses."""

    sgid: bytes
    dgid: bytes
    sgid_index: int
    path_mtu: int
    hop_limit: int = HOP_LIMIT
    traffic_class: int = 0
    flow_label: int = 0
    packet_life_time: int = CMA_IBOE_PACKET_LIFETIME
    rate: int = 0


def flow_label(sport: int, dport: int) -> int:
    """The RoCEv2 flow label rdma_cm puts in the path (cma.c
    ``cma_get_roce_udp_flow_label``); rxe derives the RC UDP source port from it."""
    return (sport * 31 + dport) & 0xFFFFF


def _open_default_ip(keep: list[CmaDevice]) -> None:
    """Fix the default device's address (it moves off a loopback address another
    process holds when it goes live) before addresses are compared with it; the caller
    releases what lands in ``keep`` once it holds the device it chose."""
    for dev in soft_devices():
        if getattr(dev, "auto_address", False) and dev.live and dev.udp is None:
            keep.append(CmaDevice.acquire(dev))


def device_for_ip(ip: IPAddress, keep: list[CmaDevice]) -> Any | None:
    """The soft device whose address is ``ip`` (IPv4-mapped IPv6 counts as IPv4). The
    default device, whose loopback address is only settled when it goes live, is opened
    for the comparison only when ``ip`` is a loopback address no other device holds (so
    a lookup never starts it, and its capture file, for nothing)."""
    if isinstance(ip, IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for dev in soft_devices():
        if ip_address(dev.ip) == ip and not (getattr(dev, "auto_address", False)
                                            and dev.udp is None):
            return dev
    if not ip.is_loopback:
        return None
    _open_default_ip(keep)
    for dev in soft_devices():
        if ip_address(dev.ip) == ip:
            return dev
    return None


#: the variable that turns interface devices off (``0``, ``no``, ``off``, ``false``)
AUTO_DEVICES_ENV = "SOFTRDMA_AUTO_DEVICES"
_auto_lock = threading.Lock()  # one device per address when two threads resolve at once


class NoDevice(PyverbsRDMAError):
    """An interface device was due but could not bind UDP 4791 on its address (taken by
    kernel rxe or another process: EADDRINUSE): ``error_code`` is the errno, the message
    says what to do."""


def auto_devices() -> bool:
    """Whether rdma_cm may make interface devices (``SOFTRDMA_AUTO_DEVICES``, on unless
    it says 0/no/off/false)."""
    v = os.environ.get(AUTO_DEVICES_ENV, "").strip().lower()
    return v not in ("0", "no", "off", "false")


def interface_device(ip: IPAddress, keep: list[CmaDevice]) -> Any | None:
    """The soft device ``softrdma-<ip>`` for a non-loopback address ``ip`` of an UP
    interface, made (and registered for the rest of the process, like the default device)
    when no device holds ``ip`` yet, as rxe's device is there on its netdev; it binds UDP
    4791 on ``ip`` now (held open through ``keep``). None when ``ip`` may not get one: a
    loopback or wildcard address, not this host's, an interface that is down, or
    ``SOFTRDMA_AUTO_DEVICES=0``. :class:`NoDevice` (the errno, and one warning in the
    log) when the device cannot bind: EADDRINUSE when UDP 4791 on ``ip`` is taken --
    kernel rxe on that interface, or another softrdma process holding the address."""
    if ip.is_loopback or ip.is_unspecified or ip.is_multicast or ip.is_link_local \
            or not auto_devices():
        return None  # (an IPv6 link-local address needs a scope no device address has)
    held = interface_of(str(ip))
    if held is None or not held[1] & IFF_UP:
        return None
    name = device_name_for(str(ip))
    with _auto_lock:
        dev = find_device(name)
        made = dev is None
        if made:
            dev = add_device(str(ip), name=name)
        try:
            keep.append(CmaDevice.acquire(dev))  # binds UDP 4791 on ip
        except PyverbsRDMAError as e:
            if made:
                unregister_device(name)
            why = (f"UDP port 4791 on {ip} is taken (kernel rxe on {held[0]}, or another "
                   f"softrdma process on {ip})" if e.error_code == errno.EADDRINUSE
                   else e.msg)
            msg = (f"no soft device on {ip} ({held[0]}): {why}; give this program another "
                   f"address (-I/-b, softrdma exec --addr, SOFTRDMA_IP)")
            log.warning("softrdma: %s", msg)  # rdma_cm's answer is an errno alone
            raise NoDevice(msg, e.error_code) from None
    log.debug("softrdma: device %s on %s for rdma_cm", name, held[0])
    return dev


def route_source(dst: IPAddress) -> IPAddress | None:
    """The source address the host's routing table picks for ``dst`` (a connected UDP
    socket sends nothing), as ``rdma_resolve_addr`` asks the IP stack."""
    fam = socket.AF_INET if dst.version == 4 else socket.AF_INET6
    try:
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect((str(dst), 9))
            return ip_address(s.getsockname()[0])
    except OSError:
        return None


def device_for_dst(dst: IPAddress, keep: list[CmaDevice]) -> Any | None:
    """The device a connection to ``dst`` leaves from: one holding ``dst`` itself
    (loopback to a local device), else the one holding the route's source address (an
    interface device made for it if none does: :func:`interface_device`), else for a
    loopback destination, or an address of this host's that another process serves, the
    default device. None when nothing reaches ``dst``; :class:`NoDevice` when the route's
    source should have a device and cannot."""
    dev = device_for_ip(dst, keep)
    if dev is not None:
        return dev
    src = route_source(dst)
    local = src is not None and src == dst  # this host's own address: loopback
    if src is not None:
        dev = device_for_ip(src, keep)
        if dev is not None:
            return dev
        if not local:
            dev = interface_device(src, keep)
            if dev is not None:
                return dev
    if dst.is_loopback or local:
        for d in soft_devices():
            if ip_address(d.ip).version == dst.version:
                return d
    return None


def parse_ip(value: Any, what: str) -> IPAddress | None:
    """An IP address from a string, bytes or address (None or "" for none); an
    IPv4-mapped IPv6 address as IPv4. EINVAL naming ``what`` otherwise."""
    if value is None or value == "":
        return None
    if isinstance(value, (IPv4Address, IPv6Address)):
        return value
    try:
        a = ip_address(value.decode() if isinstance(value, bytes) else str(value))
    except ValueError:
        raise PyverbsRDMAError(f"{what}: {value!r:.60} is not an IP address",
                               errno.EINVAL) from None
    if isinstance(a, IPv6Address) and a.ipv4_mapped is not None:
        return a.ipv4_mapped
    return a


def check_port(port: Any, what: str) -> int:
    """``port`` if it is an int in 0..65535; EINVAL naming ``what`` otherwise."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 0xFFFF:
        raise PyverbsRDMAError(f"{what}: port {port!r:.40} is not 0..65535", errno.EINVAL)
    return port
