"""Crafted packets into a soft device, from bytes or from scapy.

:meth:`SoftDevice.inject <softrdma.soft.device.SoftDevice.inject>` takes the RoCE part of a
packet (BTH .. ICRC) as bytes: the device knows nothing of scapy. A test that builds its
packet with scapy (``softrdma.wire.scapy_layers``, with or without IP/UDP under the BTH)
hands it here; the addresses it carries become the defaults for the source address and
UDP source port, as a received datagram's would.

    from scapy.layers.inet import IP, UDP
    from softrdma.harness.inject import inject_packet
    from softrdma.wire.scapy_layers import roce_packet
    pkt = (IP(src="127.0.0.62", dst="127.0.0.61") / UDP(sport=0xC000, dport=4791, chksum=0)
           / roce_packet(0x0A, dqpn=qpn, psn=5, va=buf, rkey=rkey, dma_len=5, payload=b"hi"))
    inject_packet(dev, pkt)
"""

from __future__ import annotations

from typing import Any

from ..soft.device import SoftDevice

__all__ = ["inject_packet", "roce_of_scapy"]


def roce_of_scapy(packet: Any) -> tuple[bytes, str | None, int | None]:
    """A scapy packet's RoCE part (its BTH and what follows, as bytes), its IP source
    address and its UDP source port (None where the packet has no IP or UDP layer)."""
    bth = packet.getlayer("BTH")
    if bth is None:
        raise ValueError("inject: the scapy packet has no BTH layer")
    ip = packet.getlayer("IP") or packet.getlayer("IPv6")
    udp = packet.getlayer("UDP")
    whole = bytes(packet)
    data = whole[len(whole) - len(bytes(bth)):]
    return (data, None if ip is None else str(ip.src),
            None if udp is None else int(udp.sport))


def inject_packet(dev: SoftDevice, packet: Any, *, src: str | bytes | None = None,
                  sport: int | None = None, fix_icrc: bool = True) -> None:
    """:meth:`SoftDevice.inject` for ``packet`` given as RoCE bytes or as a scapy packet:
    ``src`` and ``sport`` default to the scapy packet's IP source and UDP source port (then
    to the device's own address and 0xC000)."""
    if isinstance(packet, (bytes, bytearray, memoryview)):
        dev.inject(packet, src=src, sport=sport, fix_icrc=fix_icrc)
        return
    data, ip_src, udp_sport = roce_of_scapy(packet)
    dev.inject(data, src=ip_src if src is None else src,
               sport=udp_sport if sport is None else sport, fix_icrc=fix_icrc)
