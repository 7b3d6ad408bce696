"""From pcap records to the decoded packets the rules look at (the wire layer does the work).

A frame is RoCE when its UDP destination port is 4791. A datagram to another port whose
source address, destination address and source port belong to a RoCE flow of the same
capture and that parses as RoCE is a RoCE packet sent to the wrong port: it is kept (so the
conversation has no hole) and reported under UDP-DPORT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ..wire.frames import Frame, FrameError, decode_frame
from ..wire.headers import ROCE_V2_UDP_DPORT
from ..wire.opcodes import OpInfo
from ..wire.packet import DecodeError, RocePacket, parse
from ..wire.pcap import PcapRecord
from .rules import Sink

__all__ = ["Packet", "decode"]


@dataclass(slots=True)
class Packet:
    """One RoCE packet of the capture: its frame number and time, the IP/UDP view and the
    parsed transport headers."""

    frame: int
    ts: float
    ip: Frame
    bth: RocePacket

    @property
    def info(self) -> OpInfo:
        return self.bth.info

    @property
    def psn(self) -> int:
        return self.bth.psn

    @property
    def src(self) -> bytes:
        return self.ip.ip_src

    @property
    def dst(self) -> bytes:
        return self.ip.ip_dst


def decode(records: Iterable[PcapRecord], sink: Sink) -> tuple[list[Packet], int]:
    """Decode the RoCE frames of ``records``; report the ones that do not parse (DECODE)
    and RoCE sent elsewhere than 4791 (UDP-DPORT). Returns the packets in frame order and
    the number of frames read."""
    packets: list[Packet] = []
    elsewhere: list[tuple[PcapRecord, Frame]] = []
    flows: set[tuple[bytes, bytes, int]] = set()
    n = 0
    for r in records:
        n += 1
        try:
            f = decode_frame(r.data, r.linktype)
        except FrameError:
            continue  # IP/UDP that does not hold together: not ours to judge
        if f is None:
            continue
        if f.dport != ROCE_V2_UDP_DPORT:
            if len(f.payload) >= 16:
                elsewhere.append((r, f))
            continue
        try:
            p = parse(f.payload)
        except DecodeError as e:
            sink.add("DECODE", r.index, f"{f.src} > {f.dst}: {e}")
            continue
        flows.add((f.ip_src, f.ip_dst, f.sport))
        packets.append(Packet(r.index, r.timestamp, f, p))
    for r, f in elsewhere:
        if (f.ip_src, f.ip_dst, f.sport) not in flows:
            continue  # some other UDP traffic
        try:
            p = parse(f.payload)
        except DecodeError:
            continue
        sink.add("UDP-DPORT", r.index, f"{p.info.name} of a RoCE flow sent to UDP port "
                                       f"{f.dport}, expected {ROCE_V2_UDP_DPORT}")
        packets.append(Packet(r.index, r.timestamp, f, p))
    packets.sort(key=lambda p: p.frame)
    return packets, n
