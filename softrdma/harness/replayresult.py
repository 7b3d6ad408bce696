"""What a capture replay works on and gives back: the captured RoCE packets
(:class:`CapturedPacket`, read one at a time from a file by :func:`iter_capture`) and the
verdicts of :func:`softrdma.harness.replay.replay_side` (:class:`ReplayResult`, one
:class:`FrameVerdict` per packet the replayed endpoint sent, :class:`ExtraPacket` for each
packet softrdma sent that the capture lacks)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Iterator

from ..wire.frames import decode_frame
from ..wire.packet import DecodeError, RocePacket, parse
from ..wire.pcap import PcapError, read_pcap
from .replayloss import Evidence

__all__ = ["CapturedPacket", "ExtraPacket", "FrameVerdict", "ReplayError", "ReplayResult",
           "captured_packet", "iter_capture", "load_capture"]


@dataclass
class CapturedPacket:
    index: int
    src: bytes
    dst: bytes
    sport: int
    ip_id: int
    roce: bytes
    pkt: RocePacket


@dataclass
class FrameVerdict:
    """The judgement of one packet the real endpoint sent (capture frame ``frame``):
    ``status`` is "identical", "different" or "not judged"; ``reason`` says why it was not
    judged, or what softrdma did instead; ``ours`` is softrdma's packet paired with it
    (bytes and UDP source port), if any."""

    frame: int
    kind: str  # "request", "response" or "cm" (a MAD on QP1)
    status: str
    captured: CapturedPacket
    ours: tuple[bytes, int] | None = None
    reason: str = ""
    #: for a MAD compared field by field: (field, captured, softrdma's) of each difference
    fields: list[tuple[str, Any, Any]] | None = None


@dataclass
class ExtraPacket:
    """A packet softrdma sent that no captured packet pairs with; ``judged`` False when a
    loss before it explains it (``reason``)."""

    data: bytes
    sport: int
    after_frame: int  # the capture frame being replayed when softrdma sent it
    judged: bool
    reason: str = ""


@dataclass
class ReplayResult:
    sent: list[bytes] = field(default_factory=list)  # what softrdma transmitted
    expected: list[CapturedPacket] = field(default_factory=list)  # what the real side sent
    sports: list[int] = field(default_factory=list)
    completions: list[Any] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    # what softrdma sent after the capture's last packet from the real endpoint: answers
    # the capture may have ended too early to show (reported, not compared)
    after_capture: list[bytes] = field(default_factory=list)
    # the capture frame being replayed when softrdma sent each packet of ``sent``
    sent_at: list[int] = field(default_factory=list)
    #: one per packet of ``expected``, in capture order
    verdicts: list[FrameVerdict] = field(default_factory=list)
    #: softrdma's packets that pair with no captured one
    extra: list[ExtraPacket] = field(default_factory=list)
    #: what the capture shows of losses (:mod:`softrdma.harness.replayloss`)
    evidence: Evidence | None = None
    #: things the replay could not reconstruct (a message never captured, ...)
    notes: list[str] = field(default_factory=list)
    #: what softrdma failed to do that no captured frame shows (a CM event not raised):
    #: differences too
    failures: list[str] = field(default_factory=list)
    drops: dict[str, int] = field(default_factory=dict)

    def count(self, status: str) -> int:
        """How many of the endpoint's captured packets have ``status``."""
        return sum(1 for v in self.verdicts if v.status == status)

    @property
    def judged(self) -> int:
        return len(self.verdicts) - self.count("not judged")

    @property
    def ok(self) -> bool:
        return not self.mismatches


def load_capture(path: str) -> list[CapturedPacket]:
    return list(iter_capture(path))


def iter_capture(path: str, warnings: list[str] | None = None) -> Iterator[CapturedPacket]:
    """The capture's RoCE packets, one at a time (frames that are not RoCEv2, or whose
    RoCE packet does not parse, are skipped: they are nobody's transport). With
    ``warnings``, a file cut inside a record (tcpdump killed) is read up to the cut and a
    line saying where is added; without, the error is raised."""
    n = 0
    try:
        for r in read_pcap(path):
            n += 1
            cp = captured_packet(r)
            if cp is not None:
                yield cp
    except PcapError as e:
        if warnings is None or n == 0:
            raise
        warnings.append(f"{e}: the {n} record(s) before it are replayed")


def captured_packet(r: Any) -> CapturedPacket | None:
    """The :class:`CapturedPacket` of one pcap record, or None if it is not RoCEv2."""
    try:
        f = decode_frame(r.data, r.linktype)
        if f is None or not f.is_roce:
            return None
        roce = bytes(f.payload)
        return CapturedPacket(r.index, f.ip_src, f.ip_dst, f.sport, f.ip_id, roce, parse(roce))
    except (DecodeError, ValueError, IndexError, struct.error):
        return None


class ReplayError(Exception):
    """The conversation cannot be replayed from this side (the reason is the message)."""
