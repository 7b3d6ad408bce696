"""From pcap records to the decoded packets the rules look at (the wire layer does the work).

A frame is RoCE when its UDP destination port is 4791. A datagram to another port whose
source address, destination address and source port belong to a RoCE flow of the same
capture and that parses as RoCE is a RoCE packet sent to the wrong port: it is kept (so the
conversation has no hole) and reported under UDP-DPORT. Which flows are RoCE is known only
after the whole capture was read once, so that judgement belongs to the second pass
(``roce_flows`` given).

:func:`decode` is a generator: it holds one record at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from ..wire.frames import Frame, FrameError, decode_frame
from ..wire.headers import ROCE_V2_UDP_DPORT
from ..wire.opcodes import OpInfo
from ..wire.packet import DecodeError, RocePacket, parse
from ..wire.pcap import PcapRecord
from .rules import Sink

__all__ = ["Packet", "Counted", "decode"]


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


class Counted:
    """Wraps the records and counts them as they go by (frames, RoCE or not)."""

    def __init__(self, records: Iterable[PcapRecord]) -> None:
        self.records = records
        self.n = 0
        self.last: PcapRecord | None = None  # the record being decoded

    def __iter__(self) -> Iterator[PcapRecord]:
        for r in self.records:
            self.n += 1
            self.last = r
            yield r


def decode(records: Iterable[PcapRecord], sink: Sink,
           roce_flows: set[tuple[bytes, bytes, int]] | None = None) -> Iterator[Packet]:
    """Yield the RoCE packets of ``records`` in frame order; report the ones that do not
    parse (DECODE). With ``roce_flows`` (the second pass), also yield RoCE sent elsewhere
    than 4791 on one of those flows, reported as UDP-DPORT."""
    for r in records:
        try:
            f = decode_frame(r.data, r.linktype)
        except FrameError:
            continue  # IP/UDP that does not hold together: not ours to judge
        if f is None:
            continue
        if f.dport != ROCE_V2_UDP_DPORT:
            if (roce_flows is None or len(f.payload) < 16
                    or (f.ip_src, f.ip_dst, f.sport) not in roce_flows):
                continue  # some other UDP traffic
            try:
                p = parse(f.payload)
            except DecodeError:
                continue
            sink.add("UDP-DPORT", r.index, f"{p.info.name} of a RoCE flow sent to UDP port "
                                           f"{f.dport}, expected {ROCE_V2_UDP_DPORT}")
            yield Packet(r.index, r.timestamp, f, p)
            continue
        try:
            p = parse(f.payload)
        except DecodeError as e:
            sink.add("DECODE", r.index, f"{f.src} > {f.dst}: {e}")
            continue
        yield Packet(r.index, r.timestamp, f, p)
